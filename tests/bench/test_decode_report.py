"""The committed GPU result file has the keys issue 4 asks for, and renders as tables."""

from __future__ import annotations

import json
from pathlib import Path

from afd_ray.bench.decode_report import render

RESULT = Path(__file__).parents[2] / "benchmarks" / "results" / "h200x2-2026-11-29.json"


def test_committed_gpu_result_has_the_required_keys_and_renders():
    result = json.loads(RESULT.read_text())
    assert "H200" in result["gpu"]
    for key in ("roundtrip_us_graph", "roundtrip_us_eager"):
        assert set(result[key]) == {"1", "16", "128", "512"}
    assert 0 <= result["bulk_share_of_p2p"] <= 1
    assert 0 <= result["dbo_exposed_comm_frac"] <= 1
    tps = result["tokens_per_s_per_gpu"]
    assert set(tps) == {"afd_1a1f", "colocated_1gpu", "colocated_2gpu"}
    for layout, detail in result["tokens_per_s_per_gpu_detail"].items():
        assert detail["tokens_per_s_per_gpu"] == tps[layout]
        assert detail["tpot_ms"] <= result["tpot_budget_ms"]
    assert all(report["correctness"]["passed"] for report in result["models"].values())
    text = render(result)
    assert "| round trip per layer in graphs, T ≤ 128 (µs, worst) |" in text
    assert "## qwen3-30b-a3b-like" in text
