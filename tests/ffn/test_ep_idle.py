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
from pathlib import Path

import torch

from afd_ray.connector.channel import AttentionChannel
from afd_ray.ffn.ep import EPGroup
from afd_ray.ffn.model import load_ffn_stack
from afd_ray.models.tiny import build_tiny
from ep_pair import CPU, ep_pair

TIMEOUT_S = 30
IDLE_POLL_S = 0.02
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
    runtimes = ep_pair(checkpoint, TIMEOUT_S, IDLE_POLL_S, ep_lost_wait_s=TIMEOUT_S, group_cls=_CountingEPGroup)
    loops = [threading.Thread(target=runtime.run) for runtime in runtimes.values()]
    for loop in loops:
        loop.start()
    try:
        time.sleep(IDLE_S)
        idle = [runtime.layout.ep.agreements for runtime in runtimes.values()]
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
