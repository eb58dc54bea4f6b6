"""An idle EP group backs off: two EP ranks (threads of this process, real gloo
collectives, a tiny Qwen3-MoE) check in with each other ever less often while no
attention rank sends a step, and serve the first step after the idle spell with the
right rows.

Before, an idle rank checked in every `ffn.ep_idle_check_us` (2 ms): two idle CPU
ranks spun through about 500 all-reduces a second each.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from afd_ray.connector.channel import AttentionChannel, FFNChannel
from afd_ray.connector.process_group import new_process_group
from afd_ray.ffn.ep import EPGroup
from afd_ray.ffn.model import load_ffn_stack
from afd_ray.ffn.moe import MoE
from afd_ray.ffn.runtime import FFNRuntime
from afd_ray.models.tiny import build_tiny

CPU = torch.device("cpu")
TIMEOUT_S = 30
POLL_S, IDLE_POLL_S = 0.002, 0.02
IDLE_S = 1.0


class _CountingEPGroup(EPGroup):
    """The real EP group; counts its agreements (one all-reduce each)."""

    agreements = 0

    def agree(self, local_tokens: int, ready: bool = False, first_layer: int = 0) -> int:
        self.agreements += 1
        return super().agree(local_tokens, ready, first_layer)


def test_an_idle_ep_group_checks_in_ever_less_often_and_still_serves(tmp_path: Path) -> None:
    checkpoint = build_tiny("qwen3_moe", tmp_path / "qwen3_moe")
    full = load_ffn_stack(checkpoint, torch.float32, CPU)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=TIMEOUT_S))
    runtimes: dict[int, FFNRuntime] = {}
    errors: list[BaseException] = []

    def build(rank: int) -> None:
        try:
            stack = load_ffn_stack(checkpoint, torch.float32, CPU, ep_rank=rank, ep_size=2)
            client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
            group = new_process_group("gloo", dist.PrefixStore("ep", client), rank, 2, TIMEOUT_S)
            moe = [block for block in stack.layers if isinstance(block, MoE)]
            ep = _CountingEPGroup(group, moe[0].spec.num_experts, CPU)
            channel = FFNChannel("127.0.0.1", "gloo", TIMEOUT_S)
            runtimes[rank] = FFNRuntime(stack, channel, torch.float32, POLL_S, 0.001, ep, idle_poll_s=IDLE_POLL_S)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    builders = [threading.Thread(target=build, args=(rank,)) for rank in range(2)]
    for thread in builders:
        thread.start()
    for thread in builders:
        thread.join(TIMEOUT_S)
    assert not errors and len(runtimes) == 2, errors
    loops = [threading.Thread(target=runtime.run) for runtime in runtimes.values()]
    for loop in loops:
        loop.start()
    try:
        time.sleep(IDLE_S)
        idle = [runtime.ep.agreements for runtime in runtimes.values()]
        # Backing off from 2 ms to 20 ms: a few rounds to ramp up, then one per 20 ms
        # (about 55 in 1 s); without the backoff, up to 500.
        assert all(n <= 2 * IDLE_S / IDLE_POLL_S + 20 for n in idle), idle
        attention = AttentionChannel(runtimes[0].channel.address, 0, 0, "shm", TIMEOUT_S)
        hidden = torch.randn(3, full.hidden_size, generator=torch.Generator().manual_seed(0))
        with torch.inference_mode():
            attention.send_header(3)
            for layer in range(full.num_layers):
                torch.testing.assert_close(attention.exchange(hidden * (layer + 1)), full(layer, hidden * (layer + 1)))
        attention.close()
    finally:
        for runtime in runtimes.values():
            runtime.stop()
        for loop in loops:
            loop.join(TIMEOUT_S)
    assert not any(loop.is_alive() for loop in loops)
