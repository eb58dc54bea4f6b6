"""The FFN runtime over the real connector: M:N fan-in, batching, and idle peers.

Attention peers are `AttentionChannel`s in threads of this process; the oracle is
the same FFN stack called directly on each peer's rows.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import zmq

from afd_ray.connector.channel import AttentionChannel, FFNChannel
from afd_ray.connector.header import FFNAddress, HeaderKind, StepHeader
from afd_ray.ffn.model import FFNStack, load_ffn_stack
from afd_ray.ffn.runtime import FFNRuntime
from afd_ray.models.tiny import build_tiny

WINDOW_S = 0.05


@pytest.fixture
def runtime(stack: FFNStack, request: pytest.FixtureRequest):
    """A running FFN runtime; `@pytest.mark.window(s)` sets its batching window."""
    marker = request.node.get_closest_marker("window")
    with _running(stack, marker.args[0] if marker else WINDOW_S) as ffn:
        yield ffn


@contextlib.contextmanager
def _running(stack: FFNStack, window_s: float, ubatches: int = 1) -> Iterator[FFNRuntime]:
    """An FFN runtime serving over gloo/shm in a thread, stopped on exit."""
    channel = FFNChannel("127.0.0.1", "gloo", timeout_s=30)
    ffn = FFNRuntime(stack, channel, torch.float32, poll_s=0.05, batch_window_s=window_s, ubatches=ubatches)
    loop = threading.Thread(target=ffn.run)
    loop.start()
    try:
        yield ffn
    finally:
        ffn.stop()
        loop.join(10)


def _wait_for_steps(runtime: FFNRuntime, steps: int) -> None:
    """Wait (bounded) until the runtime has counted `steps` steps."""
    deadline = time.monotonic() + 10
    while runtime.stats.steps < steps and time.monotonic() < deadline:
        time.sleep(0.01)


def _layers_of(stack: FFNStack, hidden: torch.Tensor) -> list[torch.Tensor]:
    """Oracle: the output of every FFN layer for the inputs the peer sends."""
    return [stack(layer, hidden * (layer + 1)) for layer in range(stack.num_layers)]


def _open(runtime: FFNRuntime, peer: int) -> AttentionChannel:
    """Even peers over `shm`, odd ones over `gloo`: one FFN rank serves both at once."""
    return AttentionChannel(runtime.channel.address, peer, 0, ("shm", "gloo")[peer % 2], timeout_s=30)


def _attention_peer(runtime: FFNRuntime, channel: AttentionChannel, sizes: list[int], errors: list[str]) -> None:
    peer = channel.peer
    generator = torch.Generator().manual_seed(peer)
    with torch.inference_mode():
        for tokens in sizes:
            hidden = torch.randn(tokens, runtime.model.hidden_size, generator=generator)
            channel.send_header(tokens)
            got = [channel.exchange(hidden * (layer + 1)) for layer in range(runtime.model.num_layers)]
            for layer, (out, expected) in enumerate(zip(got, _layers_of(runtime.model, hidden))):
                if not torch.allclose(out, expected, rtol=1e-5, atol=1e-5):
                    errors.append(
                        f"peer {peer}, T={tokens}, layer {layer}: wrong rows {(out - expected).abs().max():.3g}"
                    )
    channel.close()


def _run_peers(runtime: FFNRuntime, plans: dict[int, list[int]]) -> list[str]:
    """Open every peer's channel (all admitted), then run their steps concurrently."""
    errors: list[str] = []
    channels = {peer: _open(runtime, peer) for peer in plans}
    peers = [
        threading.Thread(target=_attention_peer, args=(runtime, channels[peer], sizes, errors))
        for peer, sizes in plans.items()
    ]
    for thread in peers:
        thread.start()
    for thread in peers:
        thread.join(60)
    return errors


@pytest.mark.parametrize("ubatches", [1, 2], ids=["one-ubatch", "two-ubatches"])
def test_three_peers_on_one_ffn_rank_get_their_own_rows(stack: FFNStack, ubatches: int) -> None:
    with _running(stack, WINDOW_S, ubatches) as runtime:
        _check_three_peers(runtime)


def _check_three_peers(runtime: FFNRuntime) -> None:
    plans = {0: [5, 1, 17, 3], 1: [2, 9, 4], 2: [33]}
    assert _run_peers(runtime, plans) == []
    total = sum(sum(sizes) for sizes in plans.values())
    deadline = time.monotonic() + 10
    while runtime.stats.tokens < total and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = runtime.stats
    assert stats.tokens == sum(sum(sizes) for sizes in plans.values())
    assert stats.layers == stats.steps * runtime.model.num_layers
    # the AFD traffic per step (docs/models.md): bytes per step = 2 x L x N_tokens x H x bytes_per_elem (float32: 4)
    one_way = runtime.model.num_layers * total * runtime.model.hidden_size * 4
    assert (stats.a2f_bytes, stats.f2a_bytes) == (one_way, one_way)
    assert stats.steps <= sum(len(sizes) for sizes in plans.values())


@pytest.mark.window(30.0)
def test_peers_ready_within_the_window_share_one_step(runtime: FFNRuntime) -> None:
    # With a window longer than the test, the FFN waits until both admitted peers
    # announced their step: one step over 6 + 11 rows.
    assert _run_peers(runtime, {0: [6], 1: [11]}) == []
    _wait_for_steps(runtime, 1)
    assert runtime.stats.steps == 1
    assert runtime.stats.tokens == 17


def test_an_idle_peer_does_not_stall_a_busy_one(runtime: FFNRuntime) -> None:
    idle = _open(runtime, 7)
    busy = _open(runtime, 0)
    errors: list[str] = []
    steps = 20
    start = time.perf_counter()
    _attention_peer(runtime, busy, [4] * steps, errors)
    elapsed = time.perf_counter() - start
    assert errors == []
    _wait_for_steps(runtime, steps)  # the last F2A reaches the peer before the counter moves
    assert runtime.stats.steps == steps
    # Each step waited at most one batching window for the idle peer.
    assert elapsed < steps * (WINDOW_S + 0.5)
    idle.close()


def test_a_step_resumed_at_a_later_layer_runs_the_layers_from_it(runtime: FFNRuntime) -> None:
    """A STEP with `first_layer` (a step moved to this rank mid-way) is served from
    that layer on, with the same numbers as the whole step."""
    channel = _open(runtime, 0)
    hidden = torch.randn(3, runtime.model.hidden_size)
    channel.send_header(3, first_layer=1)
    with torch.inference_mode():
        for layer in range(1, runtime.model.num_layers):
            torch.testing.assert_close(channel.exchange(hidden), runtime.model(layer, hidden))
    _wait_for_steps(runtime, 1)
    assert runtime.stats.layers == runtime.model.num_layers - 1
    channel.close()


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_routing_sent_by_the_attention_side_is_used(tmp_path: Path, transport: str) -> None:
    """`gate_on_attention`: each layer's A2F carries top-k ids and weights with the
    rows; the FFN's output equals the whole MoE block routed the same way."""
    checkpoint = Path(build_tiny("qwen3_moe", tmp_path / "qwen3_moe"))
    full = load_ffn_stack(checkpoint, torch.float32, torch.device("cpu"))
    split = load_ffn_stack(checkpoint, torch.float32, torch.device("cpu"), gate_on_attention=True)
    runtime = FFNRuntime(split, FFNChannel("127.0.0.1", "gloo", timeout_s=30), torch.float32, 0.05, 0.0)
    loop = threading.Thread(target=runtime.run)
    loop.start()
    try:
        link = AttentionChannel(runtime.channel.address, 0, 0, transport, timeout_s=30)
        hidden = torch.randn(5, split.hidden_size)
        link.send_header(5)
        with torch.inference_mode():
            for layer, layer_id in enumerate(split.layer_ids):
                block = full.layers[full.layer_ids.index(layer_id)]
                routing = block.route(hidden)  # ids [5, k] int64, weights [5, k] float32
                got = link.exchange(hidden, (routing.ids, routing.weights))
                torch.testing.assert_close(got, block(hidden, routing))
        link.close()
    finally:
        runtime.stop()
        loop.join(10)


@pytest.mark.parametrize("ubatches", [1, 2], ids=["one-ubatch", "two-ubatches"])
def test_with_two_ubatches_a_peer_is_served_while_the_other_is_late(stack: FFNStack, ubatches: int) -> None:
    """DBO across attention ranks: peers 0 and 1 share one step (a 30 s window), and
    peer 1 sends its layer-0 rows 2 s late. With two ubatches peer 0 gets layer 0
    back at once (the FFN serves its ubatch first); with one, it waits for peer 1's
    rows too, since the FFN computes both at once."""
    with _running(stack, 30.0, ubatches) as runtime:
        first, late = _open(runtime, 0), _open(runtime, 1)
        hidden = torch.randn(4, runtime.model.hidden_size)
        first.send_header(4)
        late.send_header(4)

        def late_peer() -> None:
            time.sleep(2.0)
            with torch.inference_mode():
                for layer in range(runtime.model.num_layers):
                    late.exchange(hidden * (layer + 1))

        thread = threading.Thread(target=late_peer)
        thread.start()
        with torch.inference_mode():
            start = time.perf_counter()
            out = first.exchange(hidden)
            waited = time.perf_counter() - start
            torch.testing.assert_close(out, runtime.model(0, hidden))
            for layer in range(1, runtime.model.num_layers):
                torch.testing.assert_close(
                    first.exchange(hidden * (layer + 1)), runtime.model(layer, hidden * (layer + 1))
                )
        thread.join(30)
        assert (waited < 1.0) if ubatches == 2 else (waited > 1.9), waited
        first.close()
        late.close()


@pytest.mark.window(30.0)
def test_a_peer_announcing_its_next_step_early_gets_both_served(runtime: FFNRuntime) -> None:
    """On CUDA an attention rank's host runs ahead of its device: it may send the STEP
    header of its next step while the FFN still waits in the batching window for the
    other peers. Peer 0 announces steps of 3 and 5 rows before sending any rows; peer 1
    announces its step 0.5 s later. Both of peer 0's steps must be served, each with
    its own rows. (The second header used to replace the first inside the window: the
    FFN served the first step's rows under the second's header and never ran the
    second step; 2A:1F on an H200: an attention rank waited 120 s for its F2A.)"""
    ahead, other = _open(runtime, 0), _open(runtime, 2)
    errors: list[str] = []
    late = threading.Thread(target=lambda: (time.sleep(0.5), _attention_peer(runtime, other, [4], errors)))
    ahead.send_header(3)
    ahead.send_header(5)
    late.start()
    with torch.inference_mode():
        for tokens in (3, 5):
            hidden = torch.randn(tokens, runtime.model.hidden_size)
            for layer in range(runtime.model.num_layers):
                torch.testing.assert_close(
                    ahead.exchange(hidden * (layer + 1)), runtime.model(layer, hidden * (layer + 1))
                )
    late.join(60)
    assert errors == []
    _wait_for_steps(runtime, 2)
    steps = [[(p.rank, p.num_tokens) for p in record.peers] for record in runtime.steps.records()]
    assert steps == [[(0, 3)], [(0, 5), (2, 4)]]
    ahead.close()


@pytest.mark.window(30.0)
def test_each_step_leaves_a_timing_record_per_peer(runtime: FFNRuntime) -> None:
    """One step over two peers: one record naming both peers' step headers (the join
    key of the per-token breakdown); the peer that announced first waited longer."""
    first, second = _open(runtime, 0), _open(runtime, 1)
    errors: list[str] = []
    early = threading.Thread(target=_attention_peer, args=(runtime, first, [6], errors))
    early.start()
    time.sleep(1.0)  # peer 0's header waits in the batching window for peer 1's
    _attention_peer(runtime, second, [11], errors)
    early.join(60)
    assert errors == []
    _wait_for_steps(runtime, 1)
    (record,) = runtime.steps.records()
    assert [(p.rank, p.epoch, p.step_id, p.num_tokens) for p in record.peers] == [(0, 0, 1, 6), (1, 0, 1, 11)]
    queue = {p.rank: p.queue_s for p in record.peers}
    # Peer 0 announced about 1 s earlier (less its thread's start-up, which a loaded
    # machine can stretch: no absolute floor), so it queued longer.
    assert queue[0] > queue[1] >= 0
    assert record.compute_s > 0 and record.f2a_s >= 0 and record.ep_s == 0  # no EP group
    assert record.total_s >= record.compute_s + record.f2a_s
    assert runtime.steps.take_new() == [record] and runtime.steps.take_new() == []


@pytest.mark.window(30.0)
def test_a_peer_lost_inside_a_step_does_not_stop_the_step_or_the_loop(runtime: FFNRuntime) -> None:
    """Peers 0 (shm) and 1 (gloo) share a step; peer 0 vanishes after layer 0 (its
    pair closes mid-step). The FFN drops it and finishes the step for peer 1, whose
    rows are right, then serves peer 1's next step (a `PeerLostError` inside the step
    used to end the FFN loop; with EP the other ranks would have waited for this one)."""
    errors: list[str] = []
    channels = {peer: _open(runtime, peer) for peer in (0, 1)}
    survivor = threading.Thread(target=_attention_peer, args=(runtime, channels[1], [3, 2], errors))
    survivor.start()
    hidden = torch.randn(4, runtime.model.hidden_size)
    channels[0].send_header(4)
    channels[0].exchange(hidden)
    channels[0].close()  # gone before layer 1's A2F
    survivor.join(60)
    assert not survivor.is_alive() and errors == []
    _wait_for_steps(runtime, 2)
    assert runtime.stats.steps == 2 and runtime.channel.peers == []


def _join_and_vanish(address: FFNAddress, peer: int, transport: str) -> None:
    """An attention rank that dies between its JOIN and its rendezvous: it announces
    `transport` in the pair's store prefix and sends JOIN (what `AttentionChannel`
    does first), then never opens its side of the data plane."""
    store = dist.TCPStore(address.host, address.store_port, is_master=False, timeout=timedelta(seconds=10))
    dist.PrefixStore(f"afd/pair/{peer}/0", store).set("transport", transport)
    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.connect(f"tcp://{address.host}:{address.control_port}")
    push.send(StepHeader(HeaderKind.JOIN, peer, 0).pack())
    push.send(StepHeader(HeaderKind.STEP, peer, 0, 1, 4).pack())  # a STEP of a pair that never opened
    push.close(linger=5000)
    context.term()


def test_a_peer_that_cannot_be_admitted_does_not_stop_the_loop(stack: FFNStack) -> None:
    """Two JOINs whose admission fails: one announcing a transport a CPU rank cannot
    serve (`cuda_ipc`: `ValueError` at once), one from a rank that vanished before its
    rendezvous (`PeerLostError` after the channel's 3 s timeout), followed by a STEP of
    that never-opened pair. The loop logs and skips them and still serves a peer
    that joins afterwards."""
    runtime = FFNRuntime(stack, FFNChannel("127.0.0.1", "gloo", timeout_s=3), torch.float32, 0.05, WINDOW_S)
    loop = threading.Thread(target=runtime.run)
    loop.start()
    try:
        address = runtime.channel.address
        _join_and_vanish(address, 7, "cuda_ipc")
        _join_and_vanish(address, 8, "gloo")
        errors: list[str] = []
        _attention_peer(runtime, _open(runtime, 0), [3, 5], errors)  # admitted after 7 and 8 failed
        assert errors == []
        _wait_for_steps(runtime, 2)
        assert loop.is_alive() and runtime.stats.steps == 2
        assert not {7, 8} & set(runtime.channel.peers)
    finally:
        runtime.stop()
        loop.join(10)
