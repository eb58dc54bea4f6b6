"""The bench's FFN step split: deltas of two `/afd/status` snapshots of an FFN rank
(`FFNMember.split`) as per-step means and fractions, and its table column."""

from __future__ import annotations

from pathlib import Path

import pytest

from afd_ray.bench.cli import format_table
from afd_ray.bench.ffn_ranks import ffn_rank_result
from afd_ray.bench.runner import _SETTLE_POLL_S
from afd_ray.bench.schema import BenchResult
from afd_ray.connector.header import FFNAddress
from afd_ray.control.membership import FFNMember
from afd_ray.observability.timeline import IDLE_GAP_S, StepSplit

RESULT = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "h200-2026-12-01-product-dsv2.json"
ADDRESS = FFNAddress("127.0.0.1", 1, 2)


def _member(steps: int, timed: int, attention: float, wire: float, ffn: float, idle: float) -> FFNMember:
    return FFNMember(
        rank=0,
        address=ADDRESS,
        steps=steps,
        tokens=4 * steps,
        busy_s=0.1 * steps,
        split=StepSplit(timed, attention, wire, ffn, idle),
    )


def test_the_split_of_the_load_is_the_delta_of_the_snapshots_per_timed_step() -> None:
    before = _member(100, 12, attention=1.0, wire=1.0, ffn=1.0, idle=50.0)  # warm-up, a long idle gap
    after = _member(180, 22, attention=1.04, wire=1.001, ffn=1.05, idle=50.005)
    rank = ffn_rank_result(before, after, wall_s=10.0, layers=2, hidden=8, elem=2)
    split = rank.split
    assert split is not None and split.timed_steps == 10
    assert split.attention_ms == pytest.approx(4.0)
    assert (split.wire_ms, split.ffn_ms, split.idle_ms) == pytest.approx((0.1, 5.0, 0.5))
    assert split.step_ms == pytest.approx(9.6)
    fractions = (split.attention_fraction, split.wire_fraction, split.ffn_fraction, split.idle_fraction)
    assert sum(fractions) == pytest.approx(1.0)
    assert split.ffn_fraction == pytest.approx(5.0 / 9.6)


def test_a_load_with_no_timed_step_has_no_split() -> None:
    before = _member(100, 12, 1.0, 1.0, 1.0, 1.0)
    assert ffn_rank_result(before, _member(103, 12, 1.0, 1.0, 1.0, 1.0), 1.0, 2, 8, 2).split is None


def test_the_table_shows_each_afd_runs_split() -> None:
    result = BenchResult.model_validate_json(RESULT.read_text())
    rank = ffn_rank_result(_member(0, 0, 0, 0, 0, 0), _member(10, 2, 0.008, 0.0002, 0.01, 0.003), 1.0, 2, 8, 2)
    afd = {"ffn": [rank], "measured_bytes_per_step": 1.0, "formula_bytes_per_step": 1.0}
    runs = [run.model_copy(update=afd) if run.label == "1A1F" else run for run in result.runs]
    table = format_table(result.model_copy(update={"runs": runs}))
    header, _, *lines, legend = table.splitlines()
    assert header.endswith("split a/w/f/i")
    assert [line.endswith("4.00/0.10/5.00/1.50") for line in lines] == [False] * 3 + [True] * 3
    assert all(line.endswith("  -") for line in lines[:3])  # plain vLLM
    assert "attention/wire/FFN/idle" in legend


def test_the_pause_between_two_loads_is_no_step_of_either() -> None:
    """The bench pauses at least one settle poll between loads (warm-up, measured):
    longer than `IDLE_GAP_S`, so the first step of a load starts no interval."""
    assert _SETTLE_POLL_S > IDLE_GAP_S
