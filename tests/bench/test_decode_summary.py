"""The GPU decode benchmark's derived figures (`afd_ray.bench.decode_summary`): the step
split of a batch row and the best batch of each layout under the TPOT budget."""

from __future__ import annotations

import pytest

from afd_ray.bench.decode_summary import breakdown, summarize


def _row(afd_off: float, afd_on: float, colocated_1gpu: float, colocated_2gpu: float) -> dict:
    """A measured row (ms): AFD gpu time 1 ms under its step time; stages timed alone."""
    return {
        "afd_dbo_off": {"step_ms": afd_off, "gpu_ms": afd_off - 1},
        "afd_dbo_on": {"step_ms": afd_on, "gpu_ms": afd_on - 1},
        "attention_ub1": {"gpu_ms": 8.0},
        "attention_ub2": {"gpu_ms": 9.0},
        "ffn_ub1": {"gpu_ms": 6.0},
        "ffn_ub2": {"gpu_ms": 7.0},
        "colocated_1gpu": {"step_ms": colocated_1gpu, "gpu_ms": colocated_1gpu},
        "colocated_2gpu": {"step_ms": colocated_2gpu, "gpu_ms": colocated_2gpu},
    }


def test_breakdown_and_best_batch_under_the_tpot_budget():
    rows = {"32": _row(20.0, 15.0, 25.0, 30.0), "64": _row(70.0, 60.0, 45.0, 55.0)}
    for batch, row in rows.items():
        breakdown(int(batch), row)
    off, on = rows["32"]["afd_dbo_off_split_ms"], rows["32"]["afd_dbo_on_split_ms"]
    assert off["exposed_comm"] == pytest.approx(19.0 - (8.0 + 6.0))  # DBO off: stages in series
    assert on["exposed_comm"] == pytest.approx(14.0 - max(9.0, 7.0))  # DBO on: stages overlap
    assert on["host_and_header"] == pytest.approx(1.0)
    assert on["idle_ffn_gpu"] == pytest.approx(15.0 - 7.0)
    results = {"models": {"m": {"batches": rows}}}
    summarize(results, budget=50.0)
    best = results["models"]["m"]["best_under_tpot_budget"]
    assert best["afd_1a1f"] == {
        "tokens_per_s_per_gpu": 32 / 0.015 / 2,
        "batch_per_attention_rank": 32,
        "tpot_ms": 15.0,
    }
    assert best["colocated_1gpu"]["batch_per_attention_rank"] == 64  # 64 / 45 ms beats 32 / 25 ms
    assert best["colocated_2gpu"]["batch_per_attention_rank"] == 32  # B=64 is over the budget
    assert results["tokens_per_s_per_gpu"]["colocated_1gpu"] == pytest.approx(64 / 0.045)
    assert results["headline_model"] == "m" and results["tpot_budget_ms"] == 50.0
    assert results["dbo_exposed_comm_frac"] == pytest.approx((14.0 - 9.0) / 14.0)
