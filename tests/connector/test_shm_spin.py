"""The `shm` transport's spin phase (`connector.spin_us`): the FFN rank's value
reaches both sides of its pairs, and a spinning wait keeps every failure semantic of
a sleeping one (bounded, released by `close()`, a dead peer seen at once), over real
sockets and shared memory on loopback."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Callable

import pytest
import torch
from pydantic import ValidationError

from afd_ray.config import AFDConfig
from afd_ray.connector.channel import AttentionChannel, FFNChannel
from afd_ray.connector.header import HeaderKind
from afd_ray.connector.link import PeerLostError
from afd_ray.connector.shm import SPIN_MAX_US


def _wait_cpu_s(open_pair: Callable[..., AttentionChannel], spin_us: int) -> float:
    """CPU seconds the attention side's thread spends in an exchange the FFN never
    answers (it times out after 0.2 s), with the FFN rank's `spin_us`."""
    ffn = FFNChannel("127.0.0.1", "gloo", timeout_s=0.2, spin_us=spin_us)
    attention = open_pair(ffn, 3, "shm", timeout_s=0.2)
    start = time.thread_time()
    with pytest.raises(PeerLostError, match="no shm message within 0.2 s"):
        attention.exchange(torch.randn(2, 8))
    spent = time.thread_time() - start
    attention.close()
    ffn.close()
    return spent


def test_the_ffn_ranks_spin_reaches_the_attention_side(open_pair: Callable[..., AttentionChannel]) -> None:
    """With the FFN rank's `spin_us` at its bound (10 ms), the attention side's wait
    polls for 10 ms before it sleeps: it burns CPU that a wait without spin does not
    (a sleeping wait costs well under 1 ms; the spin, even sharing its core with
    others' work, more)."""
    sleeping, spinning = _wait_cpu_s(open_pair, 0), _wait_cpu_s(open_pair, SPIN_MAX_US)
    assert sleeping < 0.002 < spinning, (sleeping, spinning)


@pytest.mark.parametrize("spin_us", [1, SPIN_MAX_US])
def test_spinning_sides_carry_chunked_steps_bit_for_bit(
    spin_us: int, open_pair: Callable[..., AttentionChannel]
) -> None:
    """Steps of 1 to 4096 rows (the largest, 9.4 MB, goes in two chunks whose
    hand-over waits spin too) arrive unchanged both ways while both sides spin."""
    ffn = FFNChannel("127.0.0.1", "gloo", timeout_s=10, spin_us=spin_us)
    attention = open_pair(ffn, 3, "shm")
    sizes = (1, 16, 4096, 1)

    def serve() -> None:
        for _ in sizes:
            header = ffn.recv_header(10)
            for _ in range(3):
                got = ffn.recv_a2f(header.peer, torch.empty(header.num_tokens, 576))
                ffn.send_f2a(header.peer, got + 1)

    server = threading.Thread(target=serve)
    server.start()
    for tokens in sizes:
        attention.send_header(tokens)
        for layer in range(3):
            x = torch.randn(tokens, 576) * layer
            assert torch.equal(attention.exchange(x), x + 1)
    server.join(10)
    assert not server.is_alive()
    attention.close()
    ffn.close()


def test_close_releases_a_spinning_wait_at_once(open_pair: Callable[..., AttentionChannel]) -> None:
    """A close from another thread 2 ms into a 10 ms spin (the FFN never answers)
    ends the wait with `PeerLostError` ("pair closed"), not at the 30 s timeout."""
    ffn = FFNChannel("127.0.0.1", "gloo", timeout_s=30, spin_us=SPIN_MAX_US)
    attention = open_pair(ffn, 3, "shm", timeout_s=30)
    errors: list[PeerLostError] = []
    sent = threading.Event()

    def exchange() -> None:
        try:
            sent.set()
            attention.exchange(torch.randn(2, 8))
        except PeerLostError as exc:
            errors.append(exc)

    waiter = threading.Thread(target=exchange)
    start = time.monotonic()
    waiter.start()
    sent.wait(10)
    time.sleep(0.002)
    attention.close()
    waiter.join(10)
    assert not waiter.is_alive() and len(errors) == 1 and "pair closed" in str(errors[0]), errors
    assert time.monotonic() - start < 5
    ffn.close()


def _ffn_that_dies(queue: multiprocessing.Queue, ready: multiprocessing.Event) -> None:
    """FFN process: admit one peer with a 10 ms spin, read its first A2F, then exit
    without answering (its sockets close with it)."""
    ffn = FFNChannel("127.0.0.1", "gloo", timeout_s=30, spin_us=SPIN_MAX_US)
    queue.put(ffn.address)
    header = ffn.recv_header(30)
    assert header is not None and header.kind is HeaderKind.JOIN
    ffn.admit(header.peer)
    step = ffn.recv_header(30)
    ffn.recv_a2f(step.peer, torch.empty(step.num_tokens, 8))
    ready.set()
    time.sleep(0.05)  # the attention side is spinning or asleep on the F2A by now


def test_a_dead_peer_fails_a_spinning_wait_at_once() -> None:
    """The FFN process exits while the attention side waits for its F2A: the wait
    fails with `PeerLostError` well before the 30 s timeout."""
    context = multiprocessing.get_context("spawn")
    queue, ready = context.Queue(), context.Event()
    process = context.Process(target=_ffn_that_dies, args=(queue, ready))
    process.start()
    try:
        attention = AttentionChannel(queue.get(timeout=30), 3, 0, "shm", timeout_s=30)
        attention.send_header(2)
        start = time.monotonic()
        with pytest.raises(PeerLostError, match="closed the pair or died"):
            attention.exchange(torch.randn(2, 8))
        assert ready.is_set() and time.monotonic() - start < 5
        attention.close()
    finally:
        process.join(10)
        if process.is_alive():
            process.kill()


@pytest.mark.parametrize("spin_us", [-1, SPIN_MAX_US + 1])
def test_a_spin_out_of_bounds_is_refused_naming_the_field(spin_us: int) -> None:
    with pytest.raises(ValidationError, match="connector.spin_us"):
        AFDConfig.model_validate({"connector": {"spin_us": spin_us}})
    with pytest.raises(ValueError, match="connector.spin_us"):
        FFNChannel("127.0.0.1", "gloo", timeout_s=1, spin_us=spin_us)
