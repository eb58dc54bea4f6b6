"""An EP rank SIGKILLed in the middle of a step: the surviving FFN rank keeps its loop.

EP rank 1 runs in a spawned process (a real SIGKILL, real gloo EP collectives); EP
rank 0 and its attention peer (shm) run in this process. The oracle is the FFN stack
holding every expert.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from afd_ray.connector.channel import AttentionChannel, FFNChannel
from afd_ray.connector.link import PeerLostError
from afd_ray.connector.process_group import new_process_group
from afd_ray.ffn.ep import EPGroup
from afd_ray.ffn.model import FFNStack, load_ffn_stack
from afd_ray.layers.moe import MoE
from afd_ray.ffn.layout import LayoutSwitch
from afd_ray.ffn.runtime import FFNRuntime
from afd_ray.models.tiny import build_tiny

CPU = torch.device("cpu")
TIMEOUT_S = 30
EP_POLL_S = 0.002


def _ep_runtime(checkpoint: Path, port: int, ep_rank: int) -> FFNRuntime:
    """EP rank `ep_rank` of 2 over the store at `port` (blocks until both joined)."""
    stack = load_ffn_stack(checkpoint, torch.float32, CPU, ep_rank=ep_rank, ep_size=2)
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    group = new_process_group("gloo", dist.PrefixStore("ep", client), ep_rank, 2, TIMEOUT_S)
    moe = [block for block in stack.layers if isinstance(block, MoE)]
    ep = EPGroup(group, moe[0].spec.num_experts, CPU)
    channel = FFNChannel("127.0.0.1", "gloo", TIMEOUT_S)
    return FFNRuntime(stack, channel, torch.float32, EP_POLL_S, 0.001, ep, ep_lost_wait_s=TIMEOUT_S)


def _victim(checkpoint: str, port: int) -> None:
    """EP rank 1: serves its share of every step until it is killed."""
    torch.set_num_threads(1)
    _ep_runtime(Path(checkpoint), port, 1).run()


def _expected(full: FFNStack, hidden: torch.Tensor, layer: int) -> torch.Tensor:
    return full(layer, hidden * (layer + 1))


def test_a_sigkilled_ep_rank_costs_the_survivor_a_layout_switch_not_its_loop(tmp_path: Path) -> None:
    """Before, the survivor's failed all-gather ended its FFN loop: the coordinator
    then lost both FFN ranks. Now it closes its attention pair at once (the attention
    rank fails within seconds, not `timeout_s`), serves nothing until the re-formed
    layout is handed over, switches to it, and the attention rank that re-joins under
    the new epoch repeats the interrupted layer there with the right rows."""
    checkpoint = build_tiny("qwen3_moe", tmp_path / "qwen3_moe")
    full = load_ffn_stack(checkpoint, torch.float32, CPU)
    assert full.num_layers >= 2
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    victim = multiprocessing.get_context("spawn").Process(target=_victim, args=(str(checkpoint), store.port))
    victim.start()
    loop = None
    try:
        survivor = _ep_runtime(checkpoint, store.port, 0)
        loop = threading.Thread(target=survivor.run)
        loop.start()
        hidden = torch.randn(4, full.hidden_size, generator=torch.Generator().manual_seed(0))
        attention = AttentionChannel(survivor.channel.address, 0, 0, "shm", TIMEOUT_S)
        with torch.inference_mode():
            attention.send_header(4)  # one whole step over EP2
            for layer in range(full.num_layers):
                torch.testing.assert_close(attention.exchange(hidden * (layer + 1)), _expected(full, hidden, layer))
            attention.send_header(4)  # the next one: EP rank 1 dies after layer 0
            attention.exchange(hidden)
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(TIMEOUT_S)
            killed = time.monotonic()
            with pytest.raises(PeerLostError):
                attention.exchange(hidden * 2)
            assert time.monotonic() - killed < TIMEOUT_S / 3
            attention.close()
            assert loop.is_alive() and survivor.channel.peers == []
            survivor.layout.prepare_switch(LayoutSwitch(1, full, None))  # the re-formed layout: one rank, every expert
            again = AttentionChannel(survivor.channel.address, 0, 1, "shm", TIMEOUT_S)  # JOIN under epoch 1
            again.send_header(4, first_layer=1)
            for layer in range(1, full.num_layers):
                torch.testing.assert_close(again.exchange(hidden * (layer + 1)), _expected(full, hidden, layer))
            again.close()
        assert loop.is_alive() and survivor.layout.epoch == 1
    finally:
        if victim.is_alive():
            victim.kill()
            victim.join(10)
        if loop is not None:
            survivor.stop()
            loop.join(10)
