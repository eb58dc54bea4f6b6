"""A fenced FFN rank closes its EP group: two EP ranks (threads of this process, real
gloo collectives, a tiny Qwen3-MoE); the coordinator fences rank 1 (`FFNServer`
stops its loop), and rank 0 finds its EP group lost at once, not after the group's
`timeout_s`.

Before, a stopped loop closed its attention channel but left its EP group open: the
other EP ranks' next collective waited the full timeout for a rank that would never
take part again, and only then did their recovery start.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from afd_ray.connector.channel import FFNChannel
from afd_ray.connector.process_group import new_process_group
from afd_ray.ffn.ep import EPGroup
from afd_ray.ffn.model import load_ffn_stack
from afd_ray.layers.moe import MoE
from afd_ray.ffn.layout import LayoutSwitch
from afd_ray.ffn.runtime import FFNRuntime
from afd_ray.models.tiny import build_tiny
from ep_pair import CPU, POLL_S, ep_pair

TIMEOUT_S = 30
IDLE_POLL_S = 0.02


def test_a_stopped_ep_rank_closes_its_group_so_the_others_fail_fast(tmp_path: Path) -> None:
    checkpoint = build_tiny("qwen3_moe", tmp_path / "qwen3_moe")
    runtimes = ep_pair(checkpoint, TIMEOUT_S, IDLE_POLL_S, ep_lost_wait_s=TIMEOUT_S)
    loops = {rank: threading.Thread(target=runtime.run) for rank, runtime in runtimes.items()}
    for loop in loops.values():
        loop.start()
    try:
        time.sleep(0.5)  # the idle group checks in with each other
        assert not runtimes[0].layout.ep_lost
        runtimes[1].stop()  # fenced
        loops[1].join(TIMEOUT_S)
        stopped = time.monotonic()
        while not runtimes[0].layout.ep_lost:
            assert time.monotonic() - stopped < TIMEOUT_S / 3, "rank 0 still waits on the fenced rank's EP group"
            time.sleep(0.01)
        assert loops[0].is_alive()  # it waits for the re-formed layout
    finally:
        for rank, runtime in runtimes.items():
            runtime.stop()
            loops[rank].join(TIMEOUT_S)


def test_a_layout_prepared_after_the_loop_stopped_closes_its_group(tmp_path: Path) -> None:
    """FFN rank 0 prepared its EP group of a new layout (epoch 1) with rank 1, but its
    loop stopped (fenced, or failed) before the group was handed over: the group is
    shut down on hand-over, so rank 1's collective on it fails at once. Before, the
    stopped runtime kept it as its pending switch: rank 1 waited the group's full
    timeout for a rank that would never take part."""
    checkpoint = build_tiny("qwen3_moe", tmp_path / "qwen3_moe")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=TIMEOUT_S))
    groups: dict[int, dist.ProcessGroup] = {}

    def join(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
        groups[rank] = new_process_group("gloo", dist.PrefixStore("ep/1", client), rank, 2, TIMEOUT_S)

    joiners = [threading.Thread(target=join, args=(rank,)) for rank in range(2)]
    for thread in joiners:
        thread.start()
    for thread in joiners:
        thread.join(TIMEOUT_S)
    assert sorted(groups) == [0, 1]
    stack = load_ffn_stack(checkpoint, torch.float32, CPU, ep_rank=0, ep_size=2)
    runtime = FFNRuntime(
        stack, FFNChannel("127.0.0.1", "gloo", TIMEOUT_S), torch.float32, POLL_S, 0.001, idle_poll_s=IDLE_POLL_S
    )
    loop = threading.Thread(target=runtime.run)
    loop.start()
    runtime.stop()
    loop.join(TIMEOUT_S)
    (moe, *_) = [block for block in stack.layers if isinstance(block, MoE)]
    runtime.layout.prepare_switch(LayoutSwitch(1, stack, EPGroup(groups.pop(0), moe.spec.num_experts, CPU)))
    started = time.monotonic()
    with pytest.raises(RuntimeError):
        groups[1].allreduce([torch.zeros(1)]).wait()
    assert time.monotonic() - started < TIMEOUT_S / 3, "rank 1 waited on the group the stopped rank prepared"
