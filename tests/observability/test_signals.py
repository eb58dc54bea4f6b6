"""`SignalAggregator`: window percentiles over all ranks' samples, rates from counter
deltas, ranks that left or went quiet drop out."""

from __future__ import annotations

import numpy as np
import pytest

from afd_ray.observability.signals import AttentionReport, SignalAggregator
from afd_ray.observability.stats import FFNStats


def test_attention_percentiles_pool_every_rank_and_gauges_use_latest() -> None:
    signals = SignalAggregator(window_s=10)
    signals.report_attention(0, AttentionReport(ttft_s=[0.1, 0.2], tpot_s=[0.05], generation_tokens=30), now=100)
    signals.report_attention(1, AttentionReport(ttft_s=[0.3, 4.0], generation_tokens=10, running_requests=3), now=101)
    signals.report_attention(
        0, AttentionReport(tpot_s=[0.07], kv_cache_usage=0.5, waiting_requests=2, running_requests=4), now=102
    )
    snapshot = signals.snapshot(103, attention_ranks=[0, 1], ffn_ranks=[])
    assert snapshot.ttft_p90_s == pytest.approx(np.percentile([0.1, 0.2, 0.3, 4.0], 90))
    assert snapshot.tpot_p90_s == pytest.approx(np.percentile([0.05, 0.07], 90))
    assert snapshot.kv_cache_usage == pytest.approx(0.25)  # ranks 0.5 and 0.0
    assert (snapshot.waiting_requests, snapshot.running_requests) == (2, 7)
    assert snapshot.output_tokens_per_s == pytest.approx(40 / 10)
    # rank 1 left: only rank 0 counts
    assert signals.snapshot(103, [0], []).ttft_p90_s == pytest.approx(np.percentile([0.1, 0.2], 90))
    # 10 s later every sample is out of the window
    quiet = signals.snapshot(113, [0, 1], [])
    assert (quiet.ttft_p90_s, quiet.tpot_p90_s, quiet.running_requests) == (0, 0, 0)


def test_ffn_busy_and_tokens_per_step_from_counter_deltas() -> None:
    signals = SignalAggregator(window_s=10)
    for t in range(21):  # rank 0 busy 60% of the time, 8 rows per step, 5 steps/s
        signals.report_ffn(0, FFNStats(steps=5 * t, tokens=40 * t, busy_s=0.6 * t), now=float(t))
    for t in range(10, 21):  # rank 1 joined at 10 s: busy 20%, 2 rows per step
        signals.report_ffn(1, FFNStats(steps=5 * (t - 10), tokens=10 * (t - 10), busy_s=0.2 * (t - 10)), now=float(t))
    snapshot = signals.snapshot(20.0, attention_ranks=[], ffn_ranks=[0, 1])
    assert snapshot.ffn_ranks == 2
    assert snapshot.ffn_busy_fraction == pytest.approx((0.6 + 0.2) / 2)
    assert snapshot.tokens_per_ffn_step == pytest.approx((400 + 100) / (50 + 50))
    assert signals.snapshot(20.0, [], [0]).ffn_busy_fraction == pytest.approx(0.6)
    assert signals.snapshot(31.0, [], [0, 1]).ffn_busy_fraction == 0  # no report in the window
