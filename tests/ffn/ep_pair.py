"""Two EP ranks of one checkpoint as threads of the test process: a real gloo EP
group between them, each rank with its own FFN runtime and attention channel."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from afd_ray.connector.channel import FFNChannel
from afd_ray.connector.process_group import new_process_group
from afd_ray.ffn.ep import EPGroup
from afd_ray.ffn.model import load_ffn_stack
from afd_ray.layers.moe import MoE
from afd_ray.ffn.runtime import FFNRuntime

CPU = torch.device("cpu")
POLL_S = 0.002
BATCH_WINDOW_S = 0.001


def ep_pair(
    checkpoint: Path, timeout_s: float, idle_poll_s: float, ep_lost_wait_s: float, group_cls: type[EPGroup] = EPGroup
) -> dict[int, FFNRuntime]:
    """EP ranks 0 and 1 of `checkpoint` (a MoE, float32 on CPU), built at once since
    the EP group's rendezvous needs both; their runtimes by EP rank, not yet running
    (`FFNRuntime.run` in a thread each, `stop()` to end it).

    `timeout_s` bounds the rendezvous and every collective; `group_cls` wraps the EP
    group (an `EPGroup` subclass that counts its calls, say).

    Raises: AssertionError with the builders' errors if a rank was not built in
    `timeout_s`."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    runtimes: dict[int, FFNRuntime] = {}
    errors: list[BaseException] = []

    def build(rank: int) -> None:
        try:
            stack = load_ffn_stack(checkpoint, torch.float32, CPU, ep_rank=rank, ep_size=2)
            client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=timeout_s))
            group = new_process_group("gloo", dist.PrefixStore("ep", client), rank, 2, timeout_s)
            moe = [block for block in stack.layers if isinstance(block, MoE)]
            ep = group_cls(group, moe[0].spec.num_experts, CPU)
            channel = FFNChannel("127.0.0.1", "gloo", timeout_s)
            runtimes[rank] = FFNRuntime(
                stack,
                channel,
                torch.float32,
                POLL_S,
                BATCH_WINDOW_S,
                ep,
                ep_lost_wait_s=ep_lost_wait_s,
                idle_poll_s=idle_poll_s,
            )
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    builders = [threading.Thread(target=build, args=(rank,)) for rank in range(2)]
    for thread in builders:
        thread.start()
    for thread in builders:
        thread.join(timeout_s)
    assert not errors and len(runtimes) == 2, errors
    return runtimes
