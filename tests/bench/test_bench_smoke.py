"""`python -m afd_ray.bench --smoke` end to end on the session cluster.

One short request per topology, plain vLLM and 1A:1F, through the session's Serve
proxy. Checks that the result JSON is complete and its figures are positive;
performance itself is proven in benchmarks, never asserted here. The run streams
3 tokens per chunk (`--stream-interval 3`): both engines must honour it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from afd_ray.bench import BenchResult
from afd_ray.bench.cli import main


def test_smoke_run_writes_a_complete_result(serve_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "result.json"
    argv = [
        "--smoke",
        "--serve-url",
        serve_url,
        "--out",
        str(out),
        "--checkpoints",
        str(tmp_path / "tiny"),
        "--stream-interval",
        "3",
    ]
    assert main(argv) == 0

    result = BenchResult.model_validate_json(out.read_text())
    assert result.machine.logical_cores > 0 and result.machine.cpu_model
    assert [run.label for run in result.runs] == ["plain", "1A1F"]
    for run in result.runs:
        assert run.requests == 1 and run.output_tokens == result.config.max_tokens
        assert run.prompt_tokens > 0
        assert min(run.wall_s, run.output_tokens_per_s, run.deploy_s) > 0
        assert min(run.ttft.mean_ms, run.tpot.mean_ms, run.itl.p50_ms, run.e2e.p99_ms) > 0
        # 4 tokens, 3 per chunk: the first token's chunk, then one with the other 3
        # (the last token ends the stream); one token per chunk would give 3 gaps
        assert run.itl.count == 1
    plain, afd = result.runs
    assert plain.ffn == [] and plain.measured_bytes_per_step is None
    (rank,) = afd.ffn
    assert rank.steps > 0 and rank.mean_tokens_per_step > 0 and 0 < rank.busy_fraction
    assert rank.a2f_bytes_per_step == rank.f2a_bytes_per_step > 0
    assert afd.measured_bytes_per_step == pytest.approx(afd.formula_bytes_per_step)
    split = rank.split  # every FFN step is timed on CPU, but the first after the warm-up's idle gap
    assert split is not None and 0 < split.timed_steps < rank.steps
    parts = (split.attention_ms, split.wire_ms, split.ffn_ms, split.idle_ms)
    assert min(parts) >= 0 and split.ffn_ms > 0 and sum(parts) == pytest.approx(split.step_ms)

    table = capsys.readouterr().out
    assert "plain" in table and "1A1F" in table and "split a/w/f/i" in table
