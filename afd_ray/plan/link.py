"""Link latency and bandwidth of the A2F/F2A connector, measured on this machine.

`measure_link` opens one attention↔FFN pair of the connector that serves
(`afd_ray.connector.channel`: ZeroMQ step header, then per layer an A2F `[T, H]` and
an F2A `[T, H]` on the pair's process group) between this process and a spawned
loopback FFN (`afd_ray.connector.loopback`, echoing each layer), times layer round
trips for several token counts T, and fits

    round_trip(T) = 2 × latency + 2 × T × H × bytes_per_elem / bandwidth

by least squares (one message each way per layer). On one CPU host the transport is
`shm` (as `connector.transport: auto` picks there), its FFN side's backend gloo.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from collections.abc import Sequence

import torch

from afd_ray.connector.channel import AttentionChannel
from afd_ray.connector.loopback import serve_loopback_ffn
from afd_ray.plan.schema import Link
from afd_ray.connector.transports import Transport
from afd_ray.platform import Backend

__all__ = ["fit_link", "measure_link"]

_TIMEOUT_S = 60.0


def fit_link(tokens: Sequence[int], round_trip_s: Sequence[float], row_bytes: int, source: str) -> Link:
    """Least-squares fit of `round_trip = 2 × latency + 2 × tokens × row_bytes / bandwidth`.

    Args:
        tokens: token counts T (at least two distinct).
        round_trip_s: median layer round trip at each T, seconds.
        row_bytes: `H × bytes_per_elem`, bytes per token row.

    A fit whose bandwidth term comes out negative (round trips that shrink with T:
    noise above the bytes' cost) is replaced by a flat latency, the mean round trip / 2.

    Raises:
        ValueError: fewer than two distinct token counts.
    """
    if len(set(tokens)) < 2:
        raise ValueError(f"tokens: need two distinct token counts to fit a link, got {list(tokens)}")
    slope, intercept = statistics.linear_regression([2 * t * row_bytes for t in tokens], round_trip_s)
    if slope <= 0:  # no measurable size term (noise larger than the bytes' cost): a flat latency
        slope, intercept = 1e-15, statistics.fmean(round_trip_s)
    return Link(
        latency_us=max(intercept, 0.0) / 2 * 1e6,
        bandwidth_gbps=1 / max(slope, 1e-15) / 1e9,
        source=source,
    )


def measure_link(
    hidden: int,
    dtype: torch.dtype,
    transport: Transport = "shm",
    backend: Backend = "gloo",
    sizes: Sequence[int] = (1, 64, 512, 4096),
    rounds: int = 50,
) -> Link:
    """Measure the connector's layer round trip for each `sizes` token count and fit a
    `Link` (latency per message, bandwidth). Takes about a second on CPU.

    Args:
        transport: the pair's data plane; `shm`, what `connector.transport: auto` picks
            for an attention and an FFN rank on one CPU host (`gloo`: across hosts).
        backend: the FFN side's process-group backend.

    Raises:
        RuntimeError / DistStoreError: the echo process did not rendezvous within 60 s.
    """
    context = mp.get_context("spawn")
    queue = context.Queue()
    echo = context.Process(
        target=serve_loopback_ffn,
        args=(queue, backend, hidden, rounds, _TIMEOUT_S),
        kwargs={"dtype": dtype, "peers": 1},  # one step of `rounds` layers per size, then it exits on our LEAVE
        daemon=True,
    )
    echo.start()
    channel = AttentionChannel(queue.get(timeout=_TIMEOUT_S), 0, 0, transport, _TIMEOUT_S)
    medians = []
    try:
        for tokens in sizes:
            hidden_states = torch.randn(tokens, hidden).to(dtype)
            out = torch.empty_like(hidden_states)
            times = []
            channel.send_header(tokens)  # one step of `rounds` layers
            for _ in range(rounds):
                start = time.perf_counter()
                channel.exchange(hidden_states, out=out)
                times.append(time.perf_counter() - start)
            medians.append(statistics.median(times[rounds // 5 :]))
    finally:
        channel.close()
        echo.join(_TIMEOUT_S)
    row_bytes = hidden * dtype.itemsize
    return fit_link(sizes, medians, row_bytes, f"afd_ray.connector pair over {transport}, loopback, H={hidden}")
