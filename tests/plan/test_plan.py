"""The planner's model, its ranking and its inputs (no cluster, no engine).

The planner against a measured sweep: tests/examples/test_notebooks.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from afd_ray.bench import BenchResult
from afd_ray.cli import main
from afd_ray.models.shapes import shape_config
from afd_ray.plan.gpu import profile_from_bench
from afd_ray.plan.model import Layout, PerformanceModel
from afd_ray.plan.plan import MAX_BATCH, MAX_CONTEXT, MAX_DEVICES, plan_check, plan_predictions, rank_layouts
from afd_ray.plan.profile import load_profile, verdicts
from afd_ray.plan.schema import Link, PlainPoint, Profile, ServingPoint, StepPoint

RESULTS = Path(__file__).parents[2] / "benchmarks" / "results"
DSV2 = RESULTS / "h200-2026-12-03d-product-dsv2.json"
"""plain and 1A1F (with the FFN rank's step split) at batch 16 and 64, 4096-token prompts, one H200."""
FANIN = RESULTS / "h200-2026-12-03e-product-fanin.json"
"""plain, 2A1F and 2A1F-dbo at 64 streams on one H200."""


def _profile(moe: bool = True, platform: str = "cpu", latency_us: float = 0.0) -> Profile:
    """attention = 1 + b ms, FFN = 2 + 0.5 n ms, other = 0; plain = 2 + b ms on 2
    devices; 2 layers of H = 8 float32; a link of `latency_us` and infinite bandwidth."""
    points = [
        StepPoint(batch=b, context=100, step_ms=3 + 1.5 * b, attention_ms=1 + b, ffn_ms=2 + 0.5 * b) for b in (1, 2, 4)
    ]
    plain = [PlainPoint(batch=b, context=100, step_ms=2 + 1.0 * b) for b in (1, 2, 4)]
    return Profile(
        model="m",
        device="d",
        source="s",
        platform=platform,
        num_layers=2,
        hidden_size=8,
        bytes_per_elem=4,
        moe=moe,
        points=points,
        plain=plain,
        plain_devices=2,
        link=Link(latency_us=latency_us, bandwidth_gbps=1e9, source="test"),
    )


def test_the_model_reproduces_its_formulas() -> None:
    model = PerformanceModel(_profile())
    assert model.t_attn(4, 100) == pytest.approx(5) and model.t_ffn(4) == pytest.approx(4)
    # 1A1F, b=4, no DBO: other 0 + attn 5 + FFN 4 + transfer 0 = 9 ms -> 4 / 9 ms
    one = model.estimate(Layout(1, 1, 4), 100, slo_tpot_ms=10, output_tokens=4, price_per_device_hour=3.6)
    assert one.tpot_ms == pytest.approx(9) and one.tokens_per_s == pytest.approx(4 / 9e-3)
    assert one.meets_slo and one.goodput_rps == pytest.approx(one.tokens_per_s / 4)
    assert one.cost_per_1m_tokens == pytest.approx(3.6 * 2 / 3600 / one.tokens_per_s * 1e6)
    # 2A2F (EP=2): FFN rank sees n = 8 rows, half the weights and rows: (2 + 4) / 2 = 3 ms
    assert model.t_ffn_rank(2, 2, 8) == pytest.approx(3)
    # dense: no EP, each FFN rank serves ceil(A/F) = 2 peers' rows: 2 + 0.5 x 8
    assert PerformanceModel(_profile(moe=False)).t_ffn_rank(3, 2, 12) == pytest.approx(2 + 0.5 * 8)
    # a TPOT SLO below the step: no goodput
    tight = model.estimate(Layout(1, 1, 4), 100, slo_tpot_ms=8, output_tokens=4, price_per_device_hour=1.0)
    assert not tight.meets_slo and tight.goodput_rps == 0


def test_dbo_overlaps_on_own_devices_and_not_on_one_shared() -> None:
    # 2A1F-dbo, b=4, 2 layers, a 0.1 ms message: per layer t_a = attn(4)/2 = 2.5,
    # t_f = FFN(4 rows of the 8)/2 = 2, t_x = T_x(4)/2 = 2 x 0.1 = 0.2
    model = PerformanceModel(_profile(latency_us=100))
    assert model.t_transfer(4) == pytest.approx(0.4)
    dbo = model.tpot(Layout(2, 1, 4, dbo=True), 100)[0]
    assert dbo == pytest.approx(0 + 2 * max(2 * 2, 2.5 + 2 + 0.2))
    # no DBO: attn 5 + FFN(8 rows) 6 + 0.4
    assert model.tpot(Layout(2, 1, 4), 100)[0] == pytest.approx(5 + 6 + 0.4)
    # every rank on one device: the two attention ranks take turns (x2), nothing overlaps,
    # the FFN runs both ubatches: 2 x 5 + 2 x 4 + 0.4
    shared = PerformanceModel(_profile(latency_us=100), host_cores=1)
    assert shared.tpot(Layout(2, 1, 4, dbo=True), 100)[0] == pytest.approx(10 + 8 + 0.4)
    with pytest.raises(ValueError, match="DBO needs at least 2 attention ranks per FFN rank"):
        Layout(1, 1, 4, dbo=True)


def test_plain_vllm_at_equal_resources() -> None:
    # CPU: the fit of the measured plain steps, on the profile's 2 cores
    cpu = PerformanceModel(_profile())
    plain = cpu.plain(4, 100)
    assert plain.tpot_ms == pytest.approx(6) and plain.tokens_per_s == pytest.approx(4 / 6e-3)
    assert plain.devices == 2 and plain.tokens_per_s_per_device == pytest.approx(plain.tokens_per_s / 2)
    # CUDA: vLLM's MoE M(n) = plain - other - attn = (2 + b) - (1 + b) = 1 ms flat; DP+EP on 4
    # GPUs at b=2 per GPU: other 0 + attn 3 + M(8) / 4 + EP (free link) = 3.25 ms
    cuda = PerformanceModel(_profile(platform="cuda"))
    dp = cuda.plain(2, 100, gpus=4)
    assert dp.tpot_ms == pytest.approx(3.25) and dp.tokens_per_s_per_device == pytest.approx(2 / 3.25e-3)
    assert dp.tokens_per_s == pytest.approx(4 * 2 / 3.25e-3)


def test_serving_through_the_app_adds_to_both_sides() -> None:
    # plain through the app: TPOT = engine (2 + b) + serving (10 + 3 b) at b = 2 and 8
    serving = [ServingPoint(batch=b, context=100, tpot_ms=2 + b + 10 + 3 * b, load_average_1m=1.0) for b in (2, 8)]
    model = PerformanceModel(_profile().model_copy(update={"serving": serving}))
    assert model.serve_coef == pytest.approx([10, 3]) and model.t_serving(4) == pytest.approx(22)
    assert model.t_plain_engine(4, 100) == pytest.approx(6)
    assert model.plain(4, 100).tpot_ms == pytest.approx(6 + 22)
    # AFD 1A:1F at b=4: the engines' 9 ms and the same 22 ms of serving
    assert model.tpot(Layout(1, 1, 4), 100)[0] == pytest.approx(9 + 22)
    # one batch: a constant; none (or CUDA, served already): nothing
    one = PerformanceModel(_profile().model_copy(update={"serving": serving[:1]}))
    assert one.serve_coef == pytest.approx([16, 0])
    assert PerformanceModel(_profile()).t_serving(4) == 0
    cuda = _profile(platform="cuda").model_copy(update={"serving": serving})
    assert PerformanceModel(cuda).t_serving(4) == 0


def test_the_verdict_compares_with_plain_vllm_on_the_same_cores() -> None:
    """CPU, b=4: AFD 1A:1F 9 ms against plain vLLM on the same 2 cores 6 ms: plain wins."""
    verdict = verdicts(_profile())[-1]
    assert verdict.batch == 4 and verdict.afd_tpot_ms == pytest.approx(9) and verdict.plain_tpot_ms == pytest.approx(6)
    assert verdict.afd_over_plain == pytest.approx(6 / 9) and not verdict.can_pay
    assert "plain vLLM wins" in verdict.reason and "2 cores" in verdict.reason


def test_ranking_puts_the_cheapest_slo_meeting_layout_first() -> None:
    ranked = rank_layouts(
        PerformanceModel(_profile()),
        4,
        slo_tpot_ms=10,
        context=100,
        output_tokens=8,
        price_per_device_hour=1.0,
        batches=(1, 2, 4),
    )
    meeting = [e for e in ranked if e.meets_slo]
    assert meeting and ranked[: len(meeting)] == meeting
    costs = [e.cost_per_1m_tokens for e in meeting]
    assert costs == sorted(costs)
    assert all(e.layout.attention + e.layout.ffn <= 4 for e in ranked)
    assert all(e.layout.attention >= 2 * e.layout.ffn for e in ranked if e.layout.dbo)


def test_plan_predictions_pick_the_best_layout_per_gpu_count() -> None:
    model = PerformanceModel(_profile(platform="cuda"))
    predictions = plan_predictions(model, slo_tpot_ms=10, context=100, batches=(1, 2, 4))
    assert sorted(p["gpus"] for p in predictions.values()) == [2, 4, 8]
    for label, p in predictions.items():
        a, f = (int(x) for x in label.split("-")[0][:-1].split("A"))
        assert a + f == p["gpus"] and p["tpot_ms"] <= 10
        best = max(
            model.estimate(Layout(a2, p["gpus"] - a2, b, dbo), 100, 10, 1, 1.0).tokens_per_s_per_device
            for a2 in range(1, p["gpus"])
            for b in (1, 2, 4)
            for dbo in (False, True)
            if not dbo or a2 >= 2 * (p["gpus"] - a2)
            if model.tpot(Layout(a2, p["gpus"] - a2, b, dbo), 100)[0] <= 10
        )
        assert p["tok_s_per_gpu"] == pytest.approx(best)
        plain = model.plain(p["plain_batch"], 100, p["gpus"])
        assert p["plain_tok_s_per_gpu"] == pytest.approx(plain.tokens_per_s_per_device)
    with pytest.raises(ValueError, match="host_cores"):
        plan_predictions(PerformanceModel(_profile(platform="cuda"), host_cores=1), 10, 100)


def test_a_gpu_profile_from_the_benchmark_and_its_check() -> None:
    """The CUDA profile read off a committed H200 benchmark (plain + 1A1F with the FFN
    rank's step split), planned on 2/4/8 GPUs and checked against the fan-in run."""
    result = BenchResult.model_validate_json(DSV2.read_text())
    profile = profile_from_bench([result], shape_config("deepseek-v2-lite").to_dict())
    assert profile.platform == "cuda" and profile.num_layers == 27 and profile.bytes_per_elem == 2
    assert [p.batch for p in profile.points] == [16, 64] and [p.batch for p in profile.plain] == [16, 64]
    split = result.runs[-1].ffn[0].split  # 1A1F at 64: the step is its four parts
    (point,) = [p for p in profile.points if p.batch == 64]
    assert point.step_ms == pytest.approx(split.step_ms) and point.other_ms == pytest.approx(split.idle_ms)
    assert point.comm_ms == pytest.approx(2 * split.wire_ms) and point.ffn_ms == pytest.approx(split.ffn_ms)
    model = PerformanceModel(profile)
    # the fitted model reproduces the 1A1F step it was fitted to: attention, FFN and the rest
    # fit two batches exactly; the wire (0.53 ms at 16, 0.35 at 64) is a flat latency
    assert model.tpot(Layout(1, 1, 64), point.context)[0] == pytest.approx(point.step_ms, rel=0.03)
    predictions = plan_predictions(model, slo_tpot_ms=50, context=point.context)
    assert sorted(p["gpus"] for p in predictions.values()) == [2, 4, 8]
    check = plan_check(PerformanceModel(profile, host_cores=1), [BenchResult.model_validate_json(FANIN.read_text())])
    assert set(check) == {"2A1F-dbo"} and check["2A1F-dbo"]["batch"] == 32
    c = check["2A1F-dbo"]
    assert c["measured_tpot_ms"] == pytest.approx(13.33, abs=0.01)
    assert c["rel_err"] == pytest.approx(c["predicted_tpot_ms"] / c["measured_tpot_ms"] - 1)


def test_plan_cli_writes_predictions_and_the_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile_json, out = tmp_path / "profile.json", tmp_path / "plan.json"
    argv = ["profile", "--platform", "cuda", "--from-bench", str(DSV2), "--out", str(profile_json)]
    assert main(argv) == 0
    assert "plain vLLM DP+EP on 2 GPUs" in capsys.readouterr().out
    argv = ["plan", "--profile", str(profile_json), "--slo-tpot-ms", "50", "--devices", "8", "--top", "3"]
    assert main([*argv, "--measured", str(FANIN), str(DSV2), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "recommended: " in text and "equal resources: " in text and "check on one GPU" in text
    report = json.loads(out.read_text())
    assert set(report["plan_check"]) == {"1A1F", "2A1F-dbo"}
    for layout, p in report["plan_predictions"].items():
        assert {"gpus", "tok_s_per_gpu", "tpot_ms", "plain_tok_s_per_gpu"} <= set(p), layout
    assert report["equal_resources"]["winner"] in ("afd", "plain")


def test_plan_cli_on_cpu_compares_with_plain_vllm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, out = tmp_path / "profile.json", tmp_path / "plan.json"
    path.write_text(_profile().model_dump_json())
    argv = ["plan", "--profile", str(path), "--slo-tpot-ms", "10", "--devices", "2", "--batches", "1", "2", "4"]
    assert main([*argv, "--out", str(out)]) == 0
    assert "plain vLLM wins" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["host_cores"] == 2  # the cores plain vLLM was profiled on
    assert report["same_batch"]["4"]["afd_tpot_ms"] == pytest.approx(9)
    assert report["same_batch"]["4"]["plain_tpot_ms"] == pytest.approx(6)
    assert report["equal_resources"]["winner"] == "plain"


@pytest.mark.parametrize(
    ("devices", "context", "message"),
    [
        (MAX_DEVICES + 1, 100, "devices: 257 > 256, the most the planner enumerates"),
        (4, MAX_CONTEXT * 2, r"context: must be in \(0, 16777216\] tokens"),
        (4, 0, "context: must be in"),
    ],
)
def test_ranking_bounds_its_inputs(devices: int, context: float, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rank_layouts(PerformanceModel(_profile()), devices, 10, context, 8, 1.0, batches=(1,))


@pytest.mark.parametrize("batches", [(), (0,), (4, MAX_BATCH + 1)])
def test_ranking_bounds_its_batches(batches: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"batches: need at least one, each in \[1, 8192\]"):
        rank_layouts(PerformanceModel(_profile()), 4, 10, 100, 8, 1.0, batches=batches)


def test_bad_profile_files_name_the_field(tmp_path: Path) -> None:
    good = _profile().model_dump(mode="json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(good | {"points": [good["points"][0] | {"step_ms": 0}]}))
    with pytest.raises(ValueError, match=r"points\.0\.step_ms"):
        load_profile(bad)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        load_profile(bad)
    one_batch = tmp_path / "one.json"
    one_batch.write_text(json.dumps(good | {"points": good["points"][:1]}))
    with pytest.raises(ValueError, match="points: a profile needs at least two distinct batch sizes"):
        PerformanceModel(load_profile(one_batch))
    one_batch.write_text(json.dumps(good | {"plain": good["plain"][:1]}))
    with pytest.raises(ValueError, match="plain: a profile needs at least two distinct batch sizes"):
        PerformanceModel(load_profile(one_batch))


@pytest.mark.parametrize(
    ("argv", "code", "field"),
    [
        (["--slo-tpot-ms", "0", "--devices", "4"], 2, "--slo-tpot-ms"),
        (["--slo-tpot-ms", "-3", "--devices", "4"], 2, "--slo-tpot-ms"),
        (["--slo-tpot-ms", "50", "--devices", "1"], 1, "devices"),
        (["--slo-tpot-ms", "50", "--devices", "4", "--host-cores", "0"], 2, "--host-cores"),
        (["--slo-tpot-ms", "50", "--devices", "4", "--host-cores", "two"], 2, "--host-cores"),
        # --devices 100000 enumerated for hours; --context 1e12 printed TPOTs of 10^7 ms
        (["--slo-tpot-ms", "50", "--devices", "257"], 2, "argument --devices: must be <= 256, got 257"),
        (
            ["--slo-tpot-ms", "50", "--devices", "4", "--context", "1e12"],
            2,
            "argument --context: must be <= 16777216, got 1e12",
        ),
        (["--slo-tpot-ms", "50", "--devices", "4", "--context", "inf"], 2, "--context"),
        # --batches 1000000000 printed TPOTs of 7.9e7 ms in a table whose columns ran together
        (
            ["--slo-tpot-ms", "50", "--devices", "4", "--batches", "8", "1000000000"],
            2,
            "argument --batches: must be <= 8192, got 1000000000",
        ),
        # printed the whole plan, then "[Errno 2] No such file or directory: '/proc/nope'"
        (["--slo-tpot-ms", "50", "--devices", "4", "--out", "/proc/nope/plan.json"], 1, "--out: /proc/nope/plan.json"),
        # a second --profile replaces the fixture's: "[Errno 2] ..." named no flag (new-user trial)
        (
            ["--slo-tpot-ms", "50", "--devices", "4", "--profile", "/nonexistent.json"],
            1,
            "--profile: /nonexistent.json",
        ),
    ],
)
def test_plan_cli_bad_inputs(
    argv: list[str], code: int, field: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "profile.json"
    path.write_text(_profile().model_dump_json())
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--profile", str(path), *argv])
    assert exit_info.value.code == code
    assert field in capsys.readouterr().err


def test_profile_cli_bounds_its_batches(capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before any engine starts (vLLM would have been sized for 10^9 sequences)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["profile", "--tiny", "llama", "--batches", "1", "1000000000"])
    assert exit_info.value.code == 2
    assert "argument --batches: must be <= 8192, got 1000000000" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--from-bench", str(DSV2)], "--from-bench: reads GPU benchmark results; use it with --platform cuda"),
        (
            ["--platform", "cuda", "--from-bench", str(RESULTS / "h200-2026-12-03-product.json")],
            "not an afd_ray.bench result",
        ),
        (["--tiny", "llama", "--batches", "4", "4"], "batches, prompt_tokens: at least two distinct batch sizes"),
        # an unwritable --out was found only after minutes of measurement (new-user trial)
        (["--tiny", "llama", "--out", "/proc/nope/profile.json"], "--out: /proc/nope/profile.json"),
        # a missing folder gave pydantic's three-line dump naming model.source (new-user trial)
        (
            ["--model", "/nonexistent", "--no-serving", "--out", "/tmp/afd-ray-profile-test.json"],
            "afd-ray: error: --model: '/nonexistent' is neither an embedded model",
        ),
        # found only after the whole measurement, or as a pydantic dump (new-user trial)
        (["--tiny", "llama", "--out", "/tmp"], "--out: /tmp is a folder"),
        (["--tiny", "llama", "--platform", "cuda"], "--tiny: a CPU profile's random checkpoint"),
        (["--platform", "cuda", "--from-bench", "/nonexistent.json"], "--from-bench: /nonexistent.json: No such file"),
        (["--tiny", "llama", "--plain-threads", "100000"], "--plain-threads: 100000 is more than the"),
    ],
)
def test_profile_cli_names_what_is_wrong(argv: list[str], field: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before any engine or benchmark starts."""
    with pytest.raises(SystemExit) as exit_info:
        main(["profile", *argv])
    assert exit_info.value.code == 1
    assert field in capsys.readouterr().err


def test_plan_says_when_its_batch_is_beyond_the_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A profile of batches 1-8 got a recommendation at batch 128 with no word that it was
    extrapolated (new-user trial)."""
    path = tmp_path / "profile.json"
    path.write_text(_profile().model_dump_json())  # batches 1, 2, 4
    argv = ["plan", "--profile", str(path), "--slo-tpot-ms", "1000", "--devices", "2"]
    assert main([*argv, "--batches", "2", "64"]) == 0
    text = capsys.readouterr().out
    assert "recommended: " in text and "batch 64" in text
    assert "note: batch 64 per attention rank is beyond the profiled batches (at most 4)" in text
    # the equal-resources line's plain side claimed batch 512 from batches up to 8 with no word (new-user trial)
    equal = text[text.index("equal resources: ") :]
    assert "beyond the profiled batches (at most 4): extrapolated from the fits" in equal, equal
    assert main([*argv, "--batches", "2", "4"]) == 0
    assert "beyond the profiled batches" not in capsys.readouterr().out
