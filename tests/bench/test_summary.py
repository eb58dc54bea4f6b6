"""`afd_ray.bench.summary` on the committed results of the 2026-12-01 H200 run: the
values it derives must be the ones that run's hand-written results file states, and
the llama CUDA-graph record of that run (0/96 tokens equal) must make llama unequal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from afd_ray.bench.summary import main, summarize

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
RUN = "h200-2026-12-01"


def test_summary_of_the_2026_12_01_run(tmp_path: Path) -> None:
    out = tmp_path / "product.json"
    main([
        "--serve-logs", str(RESULTS / f"{RUN}-serve-one-gpu.log"), str(RESULTS / f"{RUN}-product.log"),
        "--bench", str(RESULTS / f"{RUN}-product-dsv2.json"),
        "--roundtrip", str(RESULTS / f"{RUN}-cuda-ipc-pair-mps.json"),
        "--moe-layer", str(RESULTS / f"{RUN}-moe-layer.json"),
        "--out", str(out),
    ])  # fmt: skip
    got = json.loads(out.read_text())
    stated = json.loads((RESULTS / f"{RUN}-product.json").read_text())
    for key in ("gpu", "vllm_version", "roundtrip_us_graph", "moe_layer_over_floor", "afd_over_plain_tok_s"):
        assert got[key] == stated[key], key
    assert got["equal_tokens"] == {"deepseek_v3": True, "llama": False, "qwen3_moe": True}
    assert got["equal_tokens_by_mode"]["llama"]["eager"]["equal"] is True
    assert got["equal_tokens_by_mode"]["llama"]["graphs"]["equal_positions"] == 0
    assert got["prompt_logprob_max_abs_diff"]["deepseek_v3"]["eager"] == stated["prompt_logprob_max_abs_diff"]["deepseek_v3"]
    assert got["graphs"] is False
    for batch, sides in stated["product_deepseek_v2_lite"].items():
        assert got["product"][batch]["1A1F"]["output_tok_s"] == sides["1A1F"]["output_tok_s"]


def test_a_bench_without_both_sides_is_refused(tmp_path: Path) -> None:
    result = json.loads((RESULTS / f"{RUN}-product-dsv2.json").read_text())
    result["runs"] = [run for run in result["runs"] if run["label"] == "plain"]
    bench = tmp_path / "plain-only.json"
    bench.write_text(json.dumps(result))
    with pytest.raises(ValueError, match="--bench: needs plain and 1A1F"):
        summarize([], bench, None, None)
