"""The sweep's layout spec, its bad inputs, SLO-goodput/cost arithmetic, and results
written before SLO figures were recorded (no cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest

from afd_ray.bench.cli import format_table
from afd_ray.bench.progress import PREFIX, parse_progress
from afd_ray.bench.schema import BenchResult
from afd_ray.bench.slo import slo_result
from afd_ray.bench.sweep import layouts_from_ranges, main, parse_range, plot_sweep

OLD_RESULT = Path(__file__).parents[2] / "benchmarks" / "results" / "h200-2026-12-01-product-dsv2.json"
"""A committed result written before runs carried SLO-goodput and cost."""


def test_ranges_and_lists() -> None:
    assert parse_range("--attention", "2") == (2,)
    assert parse_range("--attention", "1-3") == (1, 2, 3)
    assert parse_range("--ffn", "1,4") == (1, 4)
    assert [t.label for t in layouts_from_ranges("1-2", "1-2")] == ["1A1F", "1A2F", "2A1F", "2A2F"]


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--attention", "0-2", "--ffn", "1"], "--attention"),
        (["--attention", "3-1", "--ffn", "1"], "--attention"),
        # listing the range ended in a MemoryError
        (
            ["--attention", "1-100000000", "--ffn", "1"],
            "--attention: '1-100000000' must name at least one rank count, each from 1 to 256",
        ),
        (["--attention", "1", "--ffn", "2,100000"], "--ffn: '2,100000'"),
        (["--topologies", "1A300F"], "--topologies"),
        (["--attention", "1", "--ffn", "x"], "--ffn"),
        (["--attention", "1-2"], "--attention and --ffn"),
        (["--attention", "1", "--ffn", "1", "--topologies", "1A1F"], "--topologies"),
        ([], "--topologies"),
        (["--topologies", "1A0F"], "--topologies: topology '1A0F'"),
        (["--topologies", "1A1F", "--slo-tpot-ms", "0"], "--slo-tpot-ms"),
        (["--topologies", "1A1F", "--slo-ttft-ms", "-5"], "--slo-ttft-ms"),
        (["--topologies", "1A1F", "--price-per-device-hour", "0"], "--price-per-device-hour"),
        (["--topologies", "1A1F", "--concurrency", "1", "2"], "--concurrency"),
        (["--topologies", "1A1F", "--repeats", "2"], "--repeats: the sweep deploys each layout once"),
        # started Ray and a deployment first (new-user trial)
        (["--topologies", "1A1F", "--out", "/proc/nope/sweep.json"], "--out: /proc/nope/sweep.json"),
    ],
)
def test_bad_sweep_spec_exits_2_naming_the_field(
    argv: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert field in capsys.readouterr().err


def test_goodput_counts_requests_meeting_both_slos_and_cost_scales_with_devices() -> None:
    # request 0 meets both; 1 misses TTFT; 2 misses TPOT; 3 is exactly on both targets
    ttft = [0.5, 3.0, 0.5, 2.0]
    tpot = [0.05, 0.05, 0.2, 0.1]
    result = slo_result(
        ttft,
        tpot,
        wall_s=10.0,
        output_tokens=1000,
        devices=3,
        slo_ttft_ms=2000,
        slo_tpot_ms=100,
        price_per_device_hour=3.6,
    )
    assert result.requests_met == 2 and result.met_fraction == 0.5
    assert result.goodput_rps == pytest.approx(0.2)
    # 3 devices x 3.6/h x 10 s = 0.03 for 1000 tokens -> 30 per 1M
    assert result.cost_per_1m_output_tokens == pytest.approx(30.0)
    with pytest.raises(ValueError, match="ttft_s"):
        slo_result([0.1], [], 1.0, 1, 1, 1, 1, 1)


def test_progress_lines_parse_out_of_a_log() -> None:
    log = f'noise\n{PREFIX}{{"event": "start", "total": 2}}\nmore noise\n{PREFIX}{{"event": "done"}}\n'
    assert [e["event"] for e in parse_progress(log)] == ["start", "done"]


def test_a_result_without_slo_figures_loads_and_prints_but_is_not_plotted(tmp_path: Path) -> None:
    result = BenchResult.model_validate_json(OLD_RESULT.read_text())
    assert result.runs and all(run.slo is None for run in result.runs)
    header, _, *rows, _ = format_table(result).splitlines()
    slo_columns = slice(header.index("FFN busy") + len("FFN busy"), header.index("  c/ep ms"))
    assert len(rows) == len(result.runs) and all(row[slo_columns].split() == ["-", "-"] for row in rows)
    with pytest.raises(ValueError, match=r"runs\[\]\.slo"):
        plot_sweep(result, tmp_path / "old.png")
