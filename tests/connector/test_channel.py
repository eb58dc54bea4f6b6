"""The connector over each CPU transport (gloo pair groups, shm slots) and real ZMQ sockets on loopback."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import threading
import time
import warnings
from collections.abc import Callable

import pytest
import torch

from afd_ray.connector.channel import AttentionChannel, FFNChannel
from afd_ray.connector.header import FFNAddress, HeaderKind, StepHeader
from afd_ray.connector.link import PeerLostError
from afd_ray.connector.loopback import LoopbackFFN

H = 8
DETECT_S = 1.0
"""Bound on a waiting side learning that its pair's peer process died (one host)."""


def test_header_wire_format_round_trips():
    header = StepHeader(HeaderKind.STEP, peer=3, epoch=7, step_id=11, num_tokens=513)
    assert StepHeader.unpack(header.pack()) == header
    with pytest.raises(ValueError, match="40 bytes"):
        StepHeader.unpack(b"\x00" * 8)


def test_steps_of_varying_size_return_the_ffn_output(transport: str, open_pair: Callable[..., AttentionChannel]):
    ffn = FFNChannel("127.0.0.1", "gloo", timeout_s=10)
    attention = open_pair(ffn, 5, transport)
    sizes = [1, 7, 64, 3]
    loopback = LoopbackFFN(ffn, H, layers=1, answer=lambda layer, x: 2 * x + 1)

    def serve() -> None:
        for _ in sizes:
            header = ffn.recv_header(10)
            assert header.kind is HeaderKind.STEP and header.peer == 5
            loopback.serve_step(header)

    server = threading.Thread(target=serve)
    server.start()
    for step, tokens in enumerate(sizes, start=1):
        x = torch.randn(tokens, H)
        sent = attention.send_header(tokens)
        assert sent.step_id == step
        assert torch.equal(attention.exchange(x), 2 * x + 1)
    server.join(10)
    attention.close()
    header = ffn.recv_header(10)
    assert header.kind is HeaderKind.LEAVE
    ffn.remove(header.peer)
    assert ffn.peers == []
    ffn.close()


def test_header_of_another_epoch_is_dropped(transport: str, open_pair: Callable[..., AttentionChannel]):
    ffn = FFNChannel("127.0.0.1", "gloo", timeout_s=10, epoch=1)
    attention = open_pair(ffn, 0, transport, epoch=1)
    attention.epoch = 0  # a late sender still on the old epoch
    attention.send_header(4)
    assert ffn.recv_header(1) is None
    attention.epoch = 1
    attention.send_header(4)
    assert ffn.recv_header(1).num_tokens == 4


def test_idle_header_wait_is_bounded():
    ffn = FFNChannel("127.0.0.1", "gloo", timeout_s=10)
    start = time.monotonic()
    assert ffn.recv_header(0.2) is None
    assert time.monotonic() - start < 2
    ffn.close()


def _join_then_die(address: FFNAddress, transport: str) -> None:
    attention = AttentionChannel(address, 0, 0, transport, timeout_s=10)
    attention.send_header(4)
    time.sleep(60)


def test_dead_attention_peer_fails_the_receive_instead_of_hanging(transport: str):
    ffn = FFNChannel("127.0.0.1", "gloo", timeout_s=30)
    child = mp.get_context("spawn").Process(target=_join_then_die, args=(ffn.address, transport))
    child.start()
    join = ffn.recv_header(30)
    ffn.admit(join.peer)
    step = ffn.recv_header(30)
    assert step.kind is HeaderKind.STEP
    child.kill()
    start = time.monotonic()
    with pytest.raises(PeerLostError):
        ffn.recv_a2f(step.peer, torch.empty(step.num_tokens, H))
    assert time.monotonic() - start < DETECT_S  # the pair broke: not the 30 s timeout
    ffn.close()


def _serve_until_killed(addresses: mp.Queue, received: mp.Queue) -> None:
    """An FFN rank in its own process: admit one peer, read its STEP and the A2F of
    the first layer, say so, then wait (for SIGKILL) without answering."""
    ffn = FFNChannel("127.0.0.1", "gloo", timeout_s=30)
    addresses.put(ffn.address)
    join = ffn.recv_header(30)
    ffn.admit(join.peer)
    step = ffn.recv_header(30)
    ffn.recv_a2f(step.peer, torch.empty(step.num_tokens, H))
    received.put(step.num_tokens)
    time.sleep(60)


def test_dead_ffn_peer_fails_the_attention_wait_within_the_detection_bound(transport: str):
    """The FFN process of a real pair is SIGKILLed while its attention peer waits for
    the F2A answer: the broken pair (shm: the wake-up socket's end of file; gloo: the
    TCP connection closed by the kernel) fails the wait within `DETECT_S`, far below
    the pair's 30 s timeout; the heartbeat is only the fallback for a hung peer."""
    spawn = mp.get_context("spawn")
    addresses, received = spawn.Queue(), spawn.Queue()
    child = spawn.Process(target=_serve_until_killed, args=(addresses, received))
    child.start()
    try:
        attention = AttentionChannel(addresses.get(timeout=60), 0, 0, transport, timeout_s=30)
        attention.send_header(4)
        failed: list[float] = []

        def wait_for_answer() -> None:
            try:
                attention.exchange(torch.randn(4, H))
            except PeerLostError:
                failed.append(time.monotonic())

        waiter = threading.Thread(target=wait_for_answer)
        waiter.start()
        assert received.get(timeout=30) == 4  # the A2F arrived: the attention side waits for F2A now
        time.sleep(0.2)
        child.kill()
        killed = time.monotonic()
        waiter.join(30)
        assert failed and failed[0] - killed < DETECT_S, failed
        attention.close()
    finally:
        child.kill()
        child.join(10)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_failed_rendezvous_releases_the_attention_side(transport: str):
    """The FFN never admits: the attention side's rendezvous times out with the typed
    error, and what it opened for the pair (ZMQ socket and context, store connection)
    is closed, not left to the garbage collector (pyzmq warns about an unclosed one)."""
    ffn = FFNChannel("127.0.0.1", "gloo", timeout_s=10)
    before = _open_fds()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(PeerLostError, match="rendezvous|no shm"):
            AttentionChannel(ffn.address, 0, 0, transport, timeout_s=1)
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
    deadline = time.monotonic() + 5  # the store's server side closes its end asynchronously
    while _open_fds() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _open_fds() == before
    ffn.close()
