"""The planner's model, its ranking and its inputs (no cluster, no engine).

The profile measured by vLLM and the planner checked against a measured sweep run in
tests/examples/test_notebooks.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from afd_ray.cli import main
from afd_ray.plan.model import Layout, PerformanceModel
from afd_ray.plan.plan import MAX_BATCH, MAX_CONTEXT, MAX_DEVICES, rank_layouts
from afd_ray.plan.profile import load_profile
from afd_ray.plan.schema import Link, Profile, StepPoint

GPU_JSON = Path(__file__).parents[2] / "benchmarks" / "results" / "h200x2-2026-11-29.json"


def _profile(moe: bool = True) -> Profile:
    """attention = 1 + b ms, FFN = 2 + 0.5 n ms, other = 0, a free link; 2 layers."""
    points = [
        StepPoint(batch=b, context=100, step_ms=3 + 1.5 * b, attention_ms=1 + b, ffn_ms=2 + 0.5 * b) for b in (1, 2, 4)
    ]
    link = Link(latency_us=0, bandwidth_gbps=1e9, source="test")
    return Profile(
        model="m",
        device="d",
        source="s",
        num_layers=2,
        hidden_size=8,
        bytes_per_elem=4,
        moe=moe,
        points=points,
        link=link,
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
    assert model.t_ffn_rank(2, 2, 4) == pytest.approx(3)
    # dense: no EP, each FFN rank serves ceil(A/F) peers' rows
    assert PerformanceModel(_profile(moe=False)).t_ffn_rank(3, 2, 4) == pytest.approx(2 + 0.5 * 8)
    # DBO, b=4, two ubatches of 2: per layer t_a = attn(2)/2 = 1.5, t_f = FFN(2 rows)/2 = 1.5,
    # t_x = 0: 2 layers x 2 x max(1.5, 1.5) + (1.5 + 1.5) = 9 ms (the FFN's fixed 2 ms is paid twice)
    dbo = model.estimate(Layout(1, 1, 4, dbo=True), 100, 10, 4, 1.0)
    assert dbo.tpot_ms == pytest.approx(9)
    # a TPOT SLO below the step: no goodput
    tight = model.estimate(Layout(1, 1, 4), 100, slo_tpot_ms=8, output_tokens=4, price_per_device_hour=1.0)
    assert not tight.meets_slo and tight.goodput_rps == 0


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


def test_the_gpu_benchmark_json_is_a_profile() -> None:
    profile = load_profile(GPU_JSON, "qwen3-30b-a3b-like")
    assert profile.device.startswith("NVIDIA H200") and profile.num_layers == 48 and profile.bytes_per_elem == 2
    assert [p.batch for p in profile.points] == [32, 64, 128, 256, 512]
    assert profile.link.bandwidth_gbps > 100 and len(profile.verdicts) == 5
    with pytest.raises(ValueError, match="model: 'nope' is not in .*deepseek-v2-lite-like"):
        load_profile(GPU_JSON, "nope")


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
    ],
)
def test_plan_cli_bad_inputs(argv: list[str], code: int, field: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--profile", str(GPU_JSON), *argv])
    assert exit_info.value.code == code
    assert field in capsys.readouterr().err


def test_plan_cli_recommends_for_the_h200_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--profile", str(GPU_JSON), "--slo-tpot-ms", "50", "--devices", "8", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "recommended: " in out and "colocated, as profiled" in out


def test_profile_cli_bounds_its_batches(capsys: pytest.CaptureFixture[str]) -> None:
    """Refused before any engine starts (vLLM would have been sized for 10^9 sequences)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["profile", "--tiny", "llama", "--batches", "1", "1000000000"])
    assert exit_info.value.code == 2
    assert "argument --batches: must be <= 8192, got 1000000000" in capsys.readouterr().err
