"""The fixed concurrent load: streaming `/v1/completions` requests over httpx/asyncio.

Each stream (one per request body: the concurrency) sends requests one after another:
at least `requests_per_stream`, and more until the round has lasted `min_round_s` (so
a round is long enough to measure steady decode; every stream keeps the batch full
until then). Each request streams (SSE) with `return_token_ids`, so every chunk says
how many tokens it carries, and `stream_options.include_usage`, so the last chunk
gives the totals. All times come from `time.perf_counter()` in this process.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

__all__ = ["LoadError", "LoadResult", "RequestTiming", "run_load"]


class LoadError(RuntimeError):
    """A request failed (non-200 answer, or a stream without usage or tokens)."""


@dataclass(frozen=True)
class RequestTiming:
    """One streamed request; times are seconds from `time.perf_counter()`."""

    sent_s: float
    token_times_s: tuple[float, ...]
    """Arrival time of each token-carrying chunk, in order (at least one)."""
    output_tokens: int
    prompt_tokens: int

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] - self.sent_s

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (needs `output_tokens >= 2`)."""
        return self.decode_s / (self.output_tokens - 1)

    @property
    def decode_s(self) -> float:
        """First token to last token: the request's decode time."""
        return self.token_times_s[-1] - self.token_times_s[0]

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive token-carrying chunks."""
        times = self.token_times_s
        return [b - a for a, b in itertools.pairwise(times)]

    @property
    def e2e_s(self) -> float:
        return self.token_times_s[-1] - self.sent_s


@dataclass(frozen=True)
class LoadResult:
    wall_s: float
    """First request sent until the last one finished, seconds."""
    requests: list[RequestTiming]
    streams: int
    """Concurrent streams: the batch."""

    @property
    def decode_tokens_per_s(self) -> float:
        """Decode rate of the batch, tokens/s: the streams times the tokens after the
        first over the time after the first token, summed over the requests,
        `streams x sum_r (n_r - 1) / sum_r (t_last,r - t_first,r)`: the batch over the
        token-weighted mean time per output token. Time to first token is left out, and
        so is a request whose tokens all came in one chunk (its decode time was not
        seen).

        Raises:
            ValueError: every request's tokens came in one chunk.
        """
        timed = [r for r in self.requests if r.decode_s > 0]
        if not timed:
            raise ValueError("decode rate: every request's tokens came in one chunk; raise max_tokens")
        return self.streams * sum(r.output_tokens - 1 for r in timed) / sum(r.decode_s for r in timed)


async def _request(client: httpx.AsyncClient, path: str, body: dict[str, object]) -> RequestTiming:
    sent = time.perf_counter()
    token_times: list[float] = []
    usage: dict[str, int] | None = None
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            raise LoadError(f"POST {path}: HTTP {response.status_code}: {(await response.aread()).decode()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise LoadError(f"POST {path}: error in the stream: {chunk['error']}")
            if chunk["choices"] and chunk["choices"][0].get("token_ids"):
                token_times.append(time.perf_counter())
            usage = chunk.get("usage") or usage
    if usage is None or not token_times:
        raise LoadError(f"POST {path}: stream ended without tokens or usage")
    return RequestTiming(sent, tuple(token_times), usage["completion_tokens"], usage["prompt_tokens"])


async def _stream(
    client: httpx.AsyncClient, path: str, body: dict[str, object], count: int, until_s: float
) -> list[RequestTiming]:
    """At least `count` requests, one after another, and more until `perf_counter() >= until_s`."""
    timings: list[RequestTiming] = []
    while len(timings) < count or time.perf_counter() < until_s:
        timings.append(await _request(client, path, body))
    return timings


async def run_load(
    base_url: str,
    path: str,
    bodies: Sequence[dict[str, object]],
    requests_per_stream: int,
    timeout_s: float,
    min_round_s: float = 0.0,
) -> LoadResult:
    """Send from one stream per entry of `bodies` (the concurrency), each stream its own
    body one request after another, to `base_url + path`, and time every request. A
    stream sends `requests_per_stream` requests, and goes on sending until
    `min_round_s` seconds have passed since the round started; the round then ends
    when every stream's last request has finished (so `wall_s >= min_round_s`).

    Each body is an OpenAI completions request; streaming, token ids and usage are
    switched on here.

    Raises:
        LoadError: a request was answered with an error or an incomplete stream.
    """
    extra = {"stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()
        until = start + min_round_s
        streams = await asyncio.gather(
            *(_stream(client, path, body | extra, requests_per_stream, until) for body in bodies)
        )
        wall = time.perf_counter() - start
    return LoadResult(wall, [timing for stream in streams for timing in stream], len(bodies))
