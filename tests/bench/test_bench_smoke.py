"""`python -m afd_ray.bench --smoke` end to end on the session cluster, with two repeats.

Short requests, plain vLLM and 1A:1F, two repeats in ABBA order (plain, 1A1F, 1A1F,
plain) through the session's Serve proxy; `--no-redeploy` keeps the 1A:1F deployment
for both its repeats (3 deployments, not 4: a deployment is most of this test's
time); each measured round lasts at least `--min-round-s` (streams keep sending until
then). Checks that the result JSON is
complete, its figures positive, the runs paired by repeat, and the commit recorded;
performance itself is proven in benchmarks, never asserted here. The run streams
3 tokens per chunk (`--stream-interval 3`): both engines must honour it.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from afd_ray.bench import BenchResult
from afd_ray.bench.cli import main

MIN_ROUND_S = 0.5
MAX_TOKENS = 16
"""Enough that a request's tokens rarely all reach the client in one chunk (vLLM merges
the chunks a slow reader has not taken yet), which leaves its decode time unseen."""


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
        "--max-tokens",
        str(MAX_TOKENS),
        "--repeats",
        "2",
        "--no-redeploy",
        "--min-round-s",
        str(MIN_ROUND_S),
        "--commit",
        "test-commit",
    ]
    assert main(argv) == 0

    result = BenchResult.model_validate_json(out.read_text())
    assert result.machine.logical_cores > 0 and result.machine.cpu_model
    assert result.commit == "test-commit"
    assert [(run.label, run.repeat) for run in result.runs] == [("plain", 0), ("1A1F", 0), ("1A1F", 1), ("plain", 1)]
    for run in result.runs:
        assert run.requests >= 1 and run.output_tokens == run.requests * result.config.max_tokens
        assert run.prompt_tokens > 0 and run.wall_s >= MIN_ROUND_S
        assert min(run.output_tokens_per_s, run.decode_tokens_per_s, run.deploy_s) > 0
        assert min(run.ttft.mean_ms, run.tpot.mean_ms, run.itl.p50_ms, run.e2e.p99_ms) > 0
        # 16 tokens, 3 per chunk: the first token's chunk, then 5 with the other 15: at
        # most 5 gaps per request (fewer when vLLM merged chunks); one token per chunk
        # would give 15
        assert 1 <= run.itl.count <= 5 * run.requests
    (same,) = result.same_batch
    assert (same.family, same.layout, same.batch, same.repeats) == ("qwen3_moe", "1A1F", 1, 2)
    sides = {(run.label, run.repeat): run for run in result.runs}
    paired = [sides["1A1F", k].decode_tokens_per_s / sides["plain", k].decode_tokens_per_s for k in (0, 1)]
    assert same.ratio.decode_tok_s.median == pytest.approx(statistics.median(paired))
    assert same.ratio.decode_tok_s.min == pytest.approx(min(paired))
    plain, afd = result.runs[:2]
    assert plain.ffn == [] and plain.measured_bytes_per_step is None
    (rank,) = afd.ffn
    assert rank.steps > 0 and rank.mean_tokens_per_step > 0 and 0 < rank.busy_fraction
    assert rank.a2f_bytes_per_step == rank.f2a_bytes_per_step > 0
    # one FFN rank: its own compute per step, no EP collectives to wait in
    assert rank.compute_ms_per_step > 0 and rank.ep_ms_per_step == 0
    assert afd.measured_bytes_per_step == pytest.approx(afd.formula_bytes_per_step)
    split = rank.split  # every FFN step is timed on CPU, but the first after the warm-up's idle gap
    assert split is not None and 0 < split.timed_steps < rank.steps
    parts = (split.attention_ms, split.wire_ms, split.ffn_ms, split.idle_ms)
    assert min(parts) >= 0 and split.ffn_ms > 0 and sum(parts) == pytest.approx(split.step_ms)

    table = capsys.readouterr().out
    assert (
        "plain" in table
        and "1A1F" in table
        and "split a/w/f/i" in table
        and "c/ep ms" in table
        and "AFD/plain" in table
    )
