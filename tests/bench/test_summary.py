"""`afd_ray.bench.summary` and `afd_ray.bench.compare` on bench result files of schema 3.

The inputs are real result files: the committed H200 runs of 2026-12-03 (run D's
DeepSeek-V2-Lite bench, run E's fan-in), given the repeats, decode rates and commit a
schema-3 run records, written as JSON by the schema classes and read back by the
summary; the equality logs and the MoE-layer JSON are the committed ones as they are.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from afd_ray.bench.commit import CHECKOUT, git_commit
from afd_ray.bench.compare import compare
from afd_ray.bench.schema import BenchResult, RunResult
from afd_ray.bench.summary import main, summarize

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
DSV2 = RESULTS / "h200-2026-12-03d-product-dsv2.json"
"""plain and 1A1F of the DeepSeek-V2-Lite shape at batch 16 and 64, one repeat, schema 2."""
FANIN = RESULTS / "h200-2026-12-03e-product-fanin.json"
"""plain, 2A1F and 2A1F-dbo at batch 64."""
COMMIT = "0123456789abcdef0123456789abcdef01234567"

# (tok/s, decode tok/s, TPOT p50 ms) per repeat
PLAIN = [(100.0, 1000.0, 5.0), (200.0, 1000.0, 5.0), (120.0, 1000.0, 5.0)]
AFD = [(90.0, 950.0, 5.5), (210.0, 980.0, 5.25), (130.0, 1010.0, 5.0)]
IDLE = [0.10, 0.05, 0.20]
WIRE_MS = [0.27, 0.54, 0.81]


def _run(template: RunResult, repeat: int, figures: tuple[float, float, float], layers: int = 27) -> RunResult:
    tok_s, decode, tpot = figures
    update: dict[str, object] = {
        "repeat": repeat,
        "layers": layers,
        "output_tokens_per_s": tok_s,
        "decode_tokens_per_s": decode,
        "tpot": template.tpot.model_copy(update={"p50_ms": tpot}),
    }
    if template.ffn:
        rank = template.ffn[0]
        split = rank.split.model_copy(update={"idle_fraction": IDLE[repeat], "wire_ms": WIRE_MS[repeat]})
        update["ffn"] = [rank.model_copy(update={"split": split})]
    return template.model_copy(update=update)


def _bench(
    tmp_path: Path,
    name: str,
    sides: dict[tuple[str, int], list[tuple[float, float, float]]],
    commit: str | None = COMMIT,
    source: Path = DSV2,
) -> Path:
    """A schema-3 result: the runs of `source` for each (label, batch) of `sides`, one
    per repeat with those figures; written as JSON to `tmp_path / name`."""
    base = BenchResult.model_validate_json(source.read_text())
    templates = {(run.label, run.concurrency): run for run in base.runs}
    runs = [_run(templates[key], k, figures) for key, repeats in sides.items() for k, figures in enumerate(repeats)]
    result = base.model_copy(update={"commit": commit, "runs": runs})
    path = tmp_path / name
    path.write_text(result.model_dump_json(indent=2))
    return path


def test_same_batch_ratios_are_medians_of_the_paired_ratios(tmp_path: Path) -> None:
    bench = _bench(tmp_path, "dsv2.json", {("plain", 16): PLAIN, ("1A1F", 16): AFD})
    got = summarize(COMMIT, [bench])
    assert got["commit"] == COMMIT and got["gpu"] == "NVIDIA H200" and got["vllm_version"] == "0.26.0"
    entry = got["same_batch"]["deepseek-v2-lite"]["16"]
    # tok/s pairs: 90/100, 210/200, 130/120 -> median 1.05 (the ratio of the medians, 130/120, is not reported)
    assert entry["tok_s_ratio"] == 1.05 and entry["spread"]["tok_s_ratio"] == [0.9, round(130 / 120, 4)]
    assert entry["decode_tok_s_ratio"] == 0.98 and entry["spread"]["decode_tok_s_ratio"] == [0.95, 1.01]
    assert entry["tpot_p50_ratio"] == 1.05 and entry["spread"]["tpot_p50_ratio"] == [1.0, 1.1]
    assert entry["repeats"] == 3
    assert entry["plain"]["output_tok_s"] == {"median": 120.0, "min": 100.0, "max": 200.0}
    assert entry["afd"]["tpot_p50_ms"] == {"median": 5.25, "min": 5.0, "max": 5.5}
    # the step split of the 1A1F runs: medians over the repeats; wire per layer over 27 layers
    assert got["idle_fraction"] == {"deepseek-v2-lite": {"16": 0.1}}
    assert got["wire_us_per_layer"] == {"deepseek-v2-lite": {"16": 20.0}}
    assert got["step_split"]["deepseek-v2-lite"]["16"]["wire_ms"] == 0.54
    assert "afd_over_plain_tok_s" not in got and "product" not in got


def test_the_bench_files_of_one_run_pool_their_repeats(tmp_path: Path) -> None:
    """Two device calls of one commit: repeats 0-1 at batch 16 and 64, then one more at 16."""
    first = _bench(
        tmp_path,
        "a.json",
        {k: PLAIN[:2] for k in [("plain", 16), ("plain", 64)]}
        | {
            ("1A1F", 16): AFD[:2],
            ("1A1F", 64): AFD[:2],
        },
    )
    second = _bench(tmp_path, "b.json", {("plain", 16): PLAIN[2:], ("1A1F", 16): AFD[2:]})
    got = summarize(COMMIT, [first, second])["same_batch"]["deepseek-v2-lite"]
    assert got["16"]["repeats"] == 3 and got["16"]["tok_s_ratio"] == 1.05  # pairs (0.9, 1.05) + (130/120)
    assert got["64"]["repeats"] == 2 and got["64"]["tok_s_ratio"] == 0.975  # even count: mean of the middle two


def test_an_afd_run_without_its_plain_pair_is_refused(tmp_path: Path) -> None:
    bench = _bench(tmp_path, "dsv2.json", {("plain", 16): PLAIN[:2], ("1A1F", 16): AFD})
    with pytest.raises(ValueError, match="1A1F batch 16 repeat 2 has no plain run"):
        summarize(COMMIT, [bench])


def test_inputs_of_another_commit_are_refused(tmp_path: Path) -> None:
    bench = _bench(tmp_path, "dsv2.json", {("plain", 16): PLAIN, ("1A1F", 16): AFD}, commit="feedbeef")
    with pytest.raises(ValueError, match=f"--bench: .* commit feedbeef, not {COMMIT}"):
        summarize(COMMIT, [bench])
    with pytest.raises(ValueError, match="commit None"):  # a schema-2 result records none
        summarize(COMMIT, [DSV2])
    record = json.loads(
        (RESULTS / "h200-2026-12-03e-gpu-tests.log").read_text().split("SERVE_ONE_GPU ", 1)[1].splitlines()[0]
    )
    log = tmp_path / "equal.log"
    log.write_text("SERVE_ONE_GPU " + json.dumps(record | {"commit": "feedbeef"}) + "\n")
    with pytest.raises(ValueError, match="--serve-logs: .* commit feedbeef"):
        summarize(COMMIT, serve_logs=[log])
    log.write_text("SERVE_ONE_GPU " + json.dumps(record | {"commit": COMMIT}) + "\n")
    assert summarize(COMMIT, serve_logs=[log])["equal_tokens_run"]["qwen3_moe"]["graphs-2A1F-dbo"]["equal"]


def test_results_without_decode_rates_are_refused() -> None:
    old = BenchResult.model_validate_json(DSV2.read_text())
    with pytest.raises(ValueError, match="no decode_tokens_per_s"):
        compare(old.runs)


def test_equality_counts_every_record_of_the_run() -> None:
    """Run 2026-12-02d recorded DeepSeek-V3 with piecewise graphs three times (73, 73
    and 96 of 96 positions): it stays unequal, with all its positions, where the
    newest record alone said equal."""
    logs = [RESULTS / "h200-2026-12-02d-mla.log", RESULTS / "h200-2026-12-03e-gpu-tests.log"]
    got = summarize(COMMIT, serve_logs=logs)["equal_tokens_run"]
    graphs = got["deepseek_v3"]["graphs"]
    assert (graphs["equal"], graphs["equal_positions"], graphs["positions"]) == (False, 242, 288)
    assert got["deepseek_v3"]["eager"]["equal"] is True
    assert got["qwen3_moe"] == {
        "graphs-2A1F-dbo": {
            "equal": True,
            "equal_positions": 96,
            "positions": 96,
            "dtype": "float32",
            "prompt_logprob_max_abs_diff": 0.0002899169921875,
            "logs": ["h200-2026-12-03e-gpu-tests.log"],
        }
    }


def test_fan_in_layouts_are_compared_with_plain_at_the_same_batch(tmp_path: Path) -> None:
    sides = {("plain", 64): PLAIN, ("2A1F", 64): AFD, ("2A1F-dbo", 64): [(f[0] * 2, f[1], f[2]) for f in AFD]}
    fan_in = _bench(tmp_path, "fanin.json", sides, source=FANIN)
    got = summarize(COMMIT, fan_in=[fan_in])["fan_in"]["deepseek-v2-lite"]
    assert got["2A1F"]["64"]["tok_s_ratio"] == 1.05 and got["2A1F-dbo"]["64"]["tok_s_ratio"] == 2.1
    assert got["2A1F-dbo"]["64"]["step_split"]["idle_fraction"] == 0.1


def test_main_writes_every_key_of_the_issue(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench(tmp_path, "dsv2.json", {("plain", 16): PLAIN, ("1A1F", 16): AFD})
    plan_check = tmp_path / "plan-check.json"
    plan_check.write_text(
        json.dumps(
            {
                "plan_check": {"1A1F": {"predicted_tpot_ms": 6.0, "measured_tpot_ms": 6.3, "rel_err": -0.048}},
                "note": "the plan's own keys stay out",
            }
        )
    )
    predictions = tmp_path / "predictions.json"
    predictions.write_text(
        json.dumps({"4A4F": {"gpus": 8, "tok_s_per_gpu": 900.0, "tpot_ms": 20.0, "plain_tok_s_per_gpu": 850.0}})
    )
    ffn = tmp_path / "ffn-vs-vllm.json"
    ffn.write_text(json.dumps({"ffn_moe_over_vllm_moe": {"deepseek-v2-lite": {"16": 1.31, "64": 1.2}}}))
    out = tmp_path / "product.json"
    argv = ["--commit", COMMIT, "--bench", str(bench), "--out", str(out)]
    argv += ["--serve-logs", str(RESULTS / "h200-2026-12-03-full-graphs.log")]
    argv += ["--moe-layer", str(RESULTS / "h200-2026-12-03e-moe-layer.json")]
    argv += ["--plan-check", str(plan_check), "--plan-predictions", str(predictions), "--ffn-vs-vllm", str(ffn)]
    assert main(argv) == 0
    got = json.loads(out.read_text())
    for key in ("commit", "gpu", "vllm_version", "same_batch", "ffn_moe_over_vllm_moe", "moe_layer_over_floor"):
        assert key in got, key
    for key in ("idle_fraction", "wire_us_per_layer", "equal_tokens_run", "plan_check", "plan_predictions"):
        assert key in got, key
    assert got["moe_layer_over_floor"]["qwen3-30b-a3b"]["256"] == round(1.4081734790675193, 4)
    assert got["plan_check"] == {"1A1F": {"predicted_tpot_ms": 6.0, "measured_tpot_ms": 6.3, "rel_err": -0.048}}
    assert got["plan_predictions"]["4A4F"]["gpus"] == 8
    assert got["ffn_moe_over_vllm_moe"] == {"deepseek-v2-lite": {"16": 1.31, "64": 1.2}}
    assert set(got["equal_tokens_run"]) == {"deepseek_v3", "llama", "qwen3_moe"}
    printed = json.loads(capsys.readouterr().out)
    assert printed["same_batch"]["deepseek-v2-lite 16"]["tok_s_ratio"] == 1.05 and printed["unequal_modes"] == []


def test_a_plan_file_without_a_required_figure_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan_check = tmp_path / "plan-check.json"
    plan_check.write_text(json.dumps({"1A1F": {"predicted_tpot_ms": 6.0, "measured_tpot_ms": 6.3}}))
    with pytest.raises(SystemExit) as exit_info:
        main(["--commit", COMMIT, "--plan-check", str(plan_check), "--out", str(tmp_path / "out.json")])
    assert exit_info.value.code == 2 and "rel_err" in capsys.readouterr().err


def test_the_commit_is_read_from_the_checkout(tmp_path: Path) -> None:
    assert git_commit(tmp_path) is None  # not a git work tree: the run must pass --commit
    commit = git_commit()
    if (CHECKOUT / ".git").exists():
        assert commit is not None and re.fullmatch(r"[0-9a-f]{40}(-dirty)?", commit)
    else:
        assert commit is None


def test_fp8_runs_go_under_their_own_key(tmp_path: Path) -> None:
    """Benches with `quantization: fp8` and FP8 equality records fill `fp8` (issue 35)
    and stay out of the model-dtype `same_batch`."""
    bf16 = _bench(tmp_path, "dsv2.json", {("plain", 64): PLAIN, ("1A1F", 64): AFD})
    fp8 = _bench(tmp_path, "dsv2-fp8.json", {("plain", 64): AFD, ("1A1F", 64): PLAIN})
    result = BenchResult.model_validate_json(fp8.read_text())
    fp8.write_text(
        result.model_copy(update={"config": result.config.model_copy(update={"quantization": "fp8"})}).model_dump_json()
    )
    record = {"family": "qwen3_moe", "mode": "graphs", "dtype": "bfloat16", "quantization": "fp8", "eager": False}
    record |= {"equal_positions": 91, "positions": 96, "all_equal": False, "prompt_logprob_max_abs_diff": 0.1}
    log = tmp_path / "fp8.log"
    log.write_text("SERVE_ONE_GPU " + json.dumps(record) + "\n")
    moe_fp8 = RESULTS / "h100-2026-12-07" / "moe_fp8.json"
    got = summarize(COMMIT, [bf16, fp8], serve_logs=[log], fp8_moe_layer=moe_fp8)
    assert got["same_batch"]["deepseek-v2-lite"]["64"]["tok_s_ratio"] == 1.05
    assert got["fp8"]["same_batch"]["deepseek-v2-lite"]["64"]["tok_s_ratio"] == round(
        200 / 210, 4
    )  # pairs 100/90, 200/210, 120/130
    assert got["fp8"]["equal_tokens_run"]["qwen3_moe"]["graphs-fp8"]["equal"] is False  # 91/96 < 0.95
    assert got["equal_tokens_run"]["qwen3_moe"]["graphs-fp8"]["positions"] == 96
    assert got["fp8"]["moe_layer_over_floor"]["deepseek-v2-lite"]["256"] == pytest.approx(1.53, abs=0.01)
    assert "moe_layer_over_floor" not in got
