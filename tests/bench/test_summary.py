"""`afd_ray.bench.summary` on the committed results of the 2026-12-01 H200 run: the
values it derives must be the ones that run's hand-written results file states, and
the llama CUDA-graph record of that run (0/96 tokens equal) must make llama unequal.
A bench result with the FFN step split reports it per AFD batch (`step_split`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from afd_ray.bench.schema import BenchResult, FFNRankResult, StepSplitResult
from afd_ray.bench.summary import main, summarize

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
RUN = "h200-2026-12-01"


def test_summary_of_the_2026_12_01_run(tmp_path: Path) -> None:
    out = tmp_path / "product.json"
    main(
        [
            "--serve-logs",
            str(RESULTS / f"{RUN}-serve-one-gpu.log"),
            str(RESULTS / f"{RUN}-product.log"),
            "--bench",
            str(RESULTS / f"{RUN}-product-dsv2.json"),
            "--roundtrip",
            str(RESULTS / f"{RUN}-cuda-ipc-pair-mps.json"),
            "--moe-layer",
            str(RESULTS / f"{RUN}-moe-layer.json"),
            "--out",
            str(out),
        ]
    )
    got = json.loads(out.read_text())
    stated = json.loads((RESULTS / f"{RUN}-product.json").read_text())
    for key in ("gpu", "vllm_version", "roundtrip_us_graph", "moe_layer_over_floor", "afd_over_plain_tok_s"):
        assert got[key] == stated[key], key
    assert got["equal_tokens"] == {"deepseek_v3": True, "llama": False, "qwen3_moe": True}
    assert got["equal_tokens_by_mode"]["llama"]["eager"]["equal"] is True
    assert got["equal_tokens_by_mode"]["llama"]["graphs"]["equal_positions"] == 0
    assert (
        got["prompt_logprob_max_abs_diff"]["deepseek_v3"]["eager"]
        == stated["prompt_logprob_max_abs_diff"]["deepseek_v3"]
    )
    assert got["graphs"] is False
    for batch, sides in stated["product_deepseek_v2_lite"].items():
        assert got["product"][batch]["1A1F"]["output_tok_s"] == sides["1A1F"]["output_tok_s"]


def test_each_graph_mode_of_a_family_is_kept_apart_with_its_log() -> None:
    """The 2026-12-02 piecewise records and the 2026-12-03 whole-step (`full`) records
    of the same families are two modes each, not one replacing the other."""
    logs = [RESULTS / "h200-2026-12-02-product.log", RESULTS / "h200-2026-12-03-full-graphs.log"]
    got = summarize(logs, [], None, None)["equal_tokens_by_mode"]
    assert set(got["llama"]) == {"graphs", "full"}
    assert got["deepseek_v3"]["graphs"]["equal_positions"] == 82
    assert got["deepseek_v3"]["full"]["equal_positions"] == 96
    assert got["deepseek_v3"]["full"]["log"] == "h200-2026-12-03-full-graphs.log"


def test_a_bench_without_both_sides_is_refused(tmp_path: Path) -> None:
    result = json.loads((RESULTS / f"{RUN}-product-dsv2.json").read_text())
    result["runs"] = [run for run in result["runs"] if run["label"] == "plain"]
    bench = tmp_path / "plain-only.json"
    bench.write_text(json.dumps(result))
    with pytest.raises(ValueError, match="--bench: needs plain and 1A1F"):
        summarize([], [bench], None, None)


def test_old_bench_results_without_a_step_split_leave_the_key_out() -> None:
    got = summarize([], [RESULTS / f"{RUN}-product-dsv2.json"], None, None)
    assert "step_split" not in got


def test_the_step_split_of_each_afd_batch_is_reported(tmp_path: Path) -> None:
    result = BenchResult.model_validate_json((RESULTS / f"{RUN}-product-dsv2.json").read_text())
    runs = []
    for run in result.runs:
        if run.label == "1A1F":
            c = run.concurrency
            split = StepSplitResult(
                timed_steps=c,
                step_ms=10.0,
                attention_ms=4.0,
                wire_ms=0.5,
                ffn_ms=c / 100,
                idle_ms=5.5 - c / 100,
                attention_fraction=0.4,
                wire_fraction=0.05,
                ffn_fraction=c / 1000,
                idle_fraction=0.55 - c / 1000,
            )
            rank = FFNRankResult(
                rank=0,
                steps=c,
                tokens=c * c,
                mean_tokens_per_step=c,
                a2f_bytes_per_step=1.0,
                f2a_bytes_per_step=1.0,
                formula_bytes_per_step=1.0,
                busy_fraction=0.5,
                split=split,
            )
            run = run.model_copy(update={"ffn": [rank]})
        runs.append(run)
    bench = tmp_path / "bench.json"
    bench.write_text(result.model_copy(update={"runs": runs}).model_dump_json())

    got = summarize([], [bench], None, None)
    assert sorted(got["step_split"], key=int) == ["16", "64", "256"]  # the AFD batches only
    assert got["step_split"]["64"] == {
        "timed_steps": 64,
        "step_ms": 10.0,
        "attention_ms": 4.0,
        "wire_ms": 0.5,
        "ffn_ms": 0.64,
        "idle_ms": 4.86,
        "attention_fraction": 0.4,
        "wire_fraction": 0.05,
        "ffn_fraction": 0.064,
        "idle_fraction": 0.486,
    }


def test_other_shapes_are_reported_beside_the_main_one() -> None:
    """Run D (2026-12-03): the Qwen3-30B-A3B bench goes under `other_shapes`, with its
    own best-vs-best ratio (2434.7 / 2420.7 tok/s at batch 64); the main keys stay
    DeepSeek-V2-Lite's (5649.9 / 5978.4)."""
    got = summarize(
        [],
        [RESULTS / "h200-2026-12-03d-product-dsv2.json"],
        None,
        None,
        [RESULTS / "h200-2026-12-03d-product-qwen3.json"],
    )
    assert got["families"] == ["deepseek-v2-lite"] and got["afd_over_plain_tok_s"] == 0.945
    qwen3 = got["other_shapes"]["qwen3-30b-a3b"]
    assert qwen3["afd_over_plain_tok_s"] == round(2434.7 / 2420.7, 3)
    assert qwen3["product"]["16"]["1A1F"]["tpot_p50_ms"] == 17.14


def test_runs_of_one_shape_merge_by_batch() -> None:
    """Run D measured batches 16 and 64, run E (2026-12-03) batch 256, each with both
    sides in one run: the table holds all three, and the best batch is run E's 256
    (7654.6 / 7853.4 tok/s)."""
    got = summarize(
        [], [RESULTS / "h200-2026-12-03d-product-dsv2.json", RESULTS / "h200-2026-12-03e-product-dsv2.json"], None, None
    )
    assert sorted(got["product"], key=int) == ["16", "64", "256"]
    assert got["product"]["64"]["plain"]["output_tok_s"] == 5978.4
    assert got["afd_over_plain_tok_s"] == round(7654.6 / 7853.4, 3)
    assert got["step_split"]["256"]["timed_steps"] == 204


def test_fan_in_reports_dbo_on_over_off() -> None:
    """Run E's fan-in: 2A:1F-dbo 3699.8 tok/s over 2A:1F's 2853.5 at batch 64."""
    got = summarize([], [], None, None, fan_in_bench=RESULTS / "h200-2026-12-03e-product-fanin.json")["fan_in"]
    assert list(got) == ["64"]
    assert got["64"]["dbo_over_no_dbo"] == round(3699.8 / 2853.5, 3)
    assert got["64"]["plain"]["output_tok_s"] == 5917.9
    assert set(got["64"]["step_split"]) == {"2A1F", "2A1F-dbo"}


def test_a_fan_in_without_both_layouts_is_refused(tmp_path: Path) -> None:
    result = json.loads((RESULTS / "h200-2026-12-03e-product-fanin.json").read_text())
    result["runs"] = [run for run in result["runs"] if run["label"] != "2A1F-dbo"]
    bench = tmp_path / "no-dbo.json"
    bench.write_text(json.dumps(result))
    with pytest.raises(ValueError, match="--fan-in: batch 64 needs 2A1F and 2A1F-dbo"):
        summarize([], [], None, None, fan_in_bench=bench)
