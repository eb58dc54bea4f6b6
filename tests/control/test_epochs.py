"""Epochs and member states: a message from an older epoch is dropped, never applied.

Real ZeroMQ header sockets and each CPU data plane (gloo pair groups, shm) on loopback, and a real FFN runtime
(tiny Llama stack); the attention side runs in this thread.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from afd_ray.connector.channel import AttentionChannel, FFNChannel
from afd_ray.connector.header import HeaderKind, StepHeader
from afd_ray.control.membership import MemberState
from afd_ray.ffn.model import load_ffn_stack
from afd_ray.ffn.runtime import FFNRuntime
from afd_ray.models.tiny import build_tiny


@pytest.fixture(params=["gloo", "shm"])
def transport(request: pytest.FixtureRequest) -> str:
    """Every test runs over each CPU transport of the connector contract."""
    return request.param


def test_member_states_only_move_forward() -> None:
    state = MemberState.STARTING
    for new in (MemberState.READY, MemberState.DRAINING, MemberState.GONE):
        state = state.to(new)
    assert state is MemberState.GONE
    assert MemberState.STARTING.to(MemberState.GONE) is MemberState.GONE  # failed while starting
    for old, new in [
        (MemberState.DRAINING, MemberState.READY),
        (MemberState.GONE, MemberState.GONE),
        (MemberState.READY, MemberState.STARTING),
    ]:
        with pytest.raises(ValueError, match=f"{old.value} -> {new.value}"):
            old.to(new)


def _join(ffn: FFNChannel, peer: int, epoch: int, transport: str) -> AttentionChannel:
    """Open a pair of `epoch` (JOIN read and admitted in another thread)."""

    def admit() -> None:
        header = ffn.recv_header(10)
        assert header is not None and header.kind is HeaderKind.JOIN and header.epoch == epoch
        ffn.admit(header.peer)

    admitter = threading.Thread(target=admit)
    admitter.start()
    attention = AttentionChannel(ffn.address, peer, epoch, transport, timeout_s=10)
    admitter.join(10)
    return attention


def test_channel_drops_headers_of_a_replaced_pairing(transport: str) -> None:
    ffn = FFNChannel("127.0.0.1", "gloo", timeout_s=10)
    old = _join(ffn, 4, 1, transport)
    new = _join(ffn, 4, 3, transport)  # re-peered under a newer epoch; replaces the old pair
    assert ffn.peers == [4]
    old.send_header(5)  # a late STEP of the old pairing
    assert ffn.recv_header(1) is None
    old._push.send(StepHeader(HeaderKind.LEAVE, 4, 1).pack())  # a late LEAVE of the old pairing
    assert ffn.recv_header(1) is None
    assert ffn.peers == [4]  # never applied: the new pair stays
    old._push.send(StepHeader(HeaderKind.JOIN, 4, 2).pack())  # a stale JOIN
    assert ffn.recv_header(1) is None
    new.send_header(7)
    header = ffn.recv_header(1)
    assert (header.kind, header.epoch, header.num_tokens) == (HeaderKind.STEP, 3, 7)
    x = torch.randn(7, 8)
    server = threading.Thread(target=lambda: ffn.send_f2a(4, 2 * ffn.recv_a2f(4, torch.empty(7, 8))))
    server.start()
    assert torch.equal(new.exchange(x), 2 * x)  # the new pair carries data
    server.join(10)
    ffn.close()


def test_runtime_never_applies_a_stale_header(tmp_path: Path, transport: str) -> None:
    """A stale STEP would make the runtime post receives nobody sends (a hang); a stale
    LEAVE would drop the live pair. The runtime keeps serving the new pairing."""
    stack = load_ffn_stack(Path(build_tiny("llama", tmp_path / "llama")), torch.float32, torch.device("cpu"))
    runtime = FFNRuntime(stack, FFNChannel("127.0.0.1", "gloo", timeout_s=10), torch.float32, 0.05, 0.01)
    loop = threading.Thread(target=runtime.run)
    loop.start()
    try:
        old = AttentionChannel(runtime.channel.address, 0, 1, transport, timeout_s=10)
        old.close()  # LEAVE under epoch 1
        new = AttentionChannel(runtime.channel.address, 0, 2, transport, timeout_s=10)
        stale = AttentionChannel.__new__(AttentionChannel)
        stale.__dict__.update(new.__dict__ | {"epoch": 1})  # same socket, old epoch
        stale.send_header(3)
        stale._push.send(StepHeader(HeaderKind.LEAVE, 0, 1).pack())
        time.sleep(0.3)
        assert runtime.stats.steps == 0 and runtime.channel.peers == [0]
        hidden = torch.randn(3, stack.hidden_size)
        new.send_header(3)
        with torch.inference_mode():
            for layer in range(stack.num_layers):
                torch.testing.assert_close(new.exchange(hidden), stack(layer, hidden))
        deadline = time.monotonic() + 10
        while runtime.stats.steps < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert runtime.stats.steps == 1 and runtime.stats.tokens == 3
        new.close()
    finally:
        runtime.stop()
        loop.join(10)


def test_runtime_drops_a_peer_that_vanished_without_leave(tmp_path: Path, transport: str) -> None:
    """The coordinator reports an attention rank whose replica vanished; its FFN peer
    removes the pair at a step boundary, so steps stop waiting the batching window
    for it, and the other peer keeps being served."""
    stack = load_ffn_stack(Path(build_tiny("llama", tmp_path / "llama")), torch.float32, torch.device("cpu"))
    window_s = 0.5
    runtime = FFNRuntime(stack, FFNChannel("127.0.0.1", "gloo", timeout_s=10), torch.float32, 0.05, window_s)
    loop = threading.Thread(target=runtime.run)
    loop.start()
    try:
        AttentionChannel(runtime.channel.address, 0, 0, transport, timeout_s=10)  # joins, then never speaks
        live = AttentionChannel(runtime.channel.address, 1, 0, transport, timeout_s=10)

        def step() -> float:
            hidden = torch.randn(2, stack.hidden_size)
            start = time.perf_counter()
            live.send_header(2)
            with torch.inference_mode():
                for layer in range(stack.num_layers):
                    torch.testing.assert_close(live.exchange(hidden), stack(layer, hidden))
            return time.perf_counter() - start

        assert step() >= window_s  # waits for the silent peer
        runtime.layout.drop_peers([0])
        deadline = time.monotonic() + 10
        while runtime.channel.peers != [1] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert runtime.channel.peers == [1]
        assert step() < window_s
        live.close()
    finally:
        runtime.stop()
        loop.join(10)
