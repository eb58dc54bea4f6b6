"""Live signals: what pool members report, and the coordinator's sliding-window
aggregate of it as a `MetricsSnapshot`.

Attention ranks report `AttentionReport`s (vLLM's own stats, gathered by
`afd_ray.observability.recorder.AttentionRecorder`); FFN ranks report their cumulative
`FFNStats`. `SignalAggregator` keeps the last `window_s` seconds of both and turns
them into one snapshot: percentiles over the window's samples (not averages of
per-rank percentiles), rates from counter deltas over the window.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from afd_ray.autoscale.schema import MetricsSnapshot
from afd_ray.observability.stats import FFNStats

__all__ = ["AttentionReport", "SignalAggregator", "p90"]


class AttentionReport(BaseModel):
    """What one attention rank saw since its previous report (vLLM's stats)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ttft_s: list[float] = []
    """Time to first token of each request that got its first token, seconds."""
    tpot_s: list[float] = []
    """Mean time per output token of each finished request with at least two output
    tokens, seconds."""
    generation_tokens: int = Field(0, ge=0)
    """Tokens generated."""
    kv_cache_usage: float = Field(0.0, ge=0, le=1)
    """Latest fraction of KV-cache blocks in use."""
    waiting_requests: int = Field(0, ge=0)
    """Latest number of requests waiting to be scheduled."""
    running_requests: int = Field(0, ge=0)
    """Latest number of requests being decoded."""


def p90(values: list[float]) -> float:
    """The 90th percentile of `values` (numpy's default linear interpolation); 0.0
    for no values."""
    return float(np.percentile(values, 90)) if values else 0.0


@dataclass(frozen=True)
class _Report:
    time_s: float
    attention: AttentionReport


@dataclass(frozen=True)
class _Counters:
    time_s: float
    stats: FFNStats


class SignalAggregator:
    """Sliding-window aggregate of the pools' reports (held by the coordinator).

    Times are the caller's clock (the coordinator passes `time.time()` at receipt), in
    seconds. A rank that stopped reporting drops out once its reports are older than
    the window, and `snapshot` covers only the ranks it is given (the live ones).

    Args:
        window_s: length of the sliding window, seconds.
    """

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._attention: dict[int, deque[_Report]] = {}
        self._ffn: dict[int, deque[_Counters]] = {}

    def report_attention(self, rank: int, report: AttentionReport, now: float) -> None:
        """Add attention rank `rank`'s report received at `now`."""
        reports = self._attention.setdefault(rank, deque())
        reports.append(_Report(now, report))
        while reports[0].time_s < now - self.window_s:
            reports.popleft()

    def report_ffn(self, rank: int, stats: FFNStats, now: float) -> None:
        """Add FFN rank `rank`'s cumulative counters received at `now`. The oldest
        entry kept is the last one at or before the window's start, so deltas span
        the whole window."""
        counters = self._ffn.setdefault(rank, deque())
        counters.append(_Counters(now, stats))
        while len(counters) > 1 and counters[1].time_s <= now - self.window_s:
            counters.popleft()

    def snapshot(self, now: float, attention_ranks: Iterable[int], ffn_ranks: Iterable[int]) -> MetricsSnapshot:
        """The signals of the given live ranks over `[now - window_s, now]`.

        - `kv_cache_usage`: mean over ranks of each rank's latest report;
          `waiting_requests`, `running_requests`: sums of the latest reports.
        - `ttft_p90_s`, `tpot_p90_s`: `p90` of all samples in the window.
        - `output_tokens_per_s`: generated tokens in the window / `window_s`.
        - `ffn_busy_fraction`: mean over FFN ranks of Δ`busy_s` / Δt between the
          oldest and newest counters kept (clamped to [0, 1]).
        - `tokens_per_ffn_step`: Σ Δ`tokens` / Σ Δ`steps` over FFN ranks (0 without steps).
        """
        start = now - self.window_s
        attention, ffn = list(attention_ranks), list(ffn_ranks)
        latest: list[AttentionReport] = []
        ttft: list[float] = []
        tpot: list[float] = []
        tokens = 0
        for rank in attention:
            reports = [r for r in self._attention.get(rank, ()) if r.time_s >= start]
            if not reports:
                continue
            latest.append(reports[-1].attention)
            for report in reports:
                ttft.extend(report.attention.ttft_s)
                tpot.extend(report.attention.tpot_s)
                tokens += report.attention.generation_tokens
        busy: list[float] = []
        ffn_tokens = ffn_steps = 0
        for rank in ffn:
            counters = self._ffn.get(rank)
            if not counters or counters[-1].time_s < start or len(counters) < 2:
                continue
            first, last = counters[0], counters[-1]
            busy.append(min(max((last.stats.busy_s - first.stats.busy_s) / (last.time_s - first.time_s), 0.0), 1.0))
            ffn_tokens += last.stats.tokens - first.stats.tokens
            ffn_steps += last.stats.steps - first.stats.steps
        return MetricsSnapshot(
            time_s=now,
            attention_ranks=len(attention),
            ffn_ranks=len(ffn),
            kv_cache_usage=sum(r.kv_cache_usage for r in latest) / len(latest) if latest else 0.0,
            waiting_requests=sum(r.waiting_requests for r in latest),
            running_requests=sum(r.running_requests for r in latest),
            ttft_p90_s=p90(ttft),
            tpot_p90_s=p90(tpot),
            ffn_busy_fraction=sum(busy) / len(busy) if busy else 0.0,
            tokens_per_ffn_step=ffn_tokens / ffn_steps if ffn_steps else 0.0,
            output_tokens_per_s=tokens / self.window_s,
        )
