"""`python -m afd_ray.bench --smoke` end to end on the session cluster, with two repeats.

Short requests, plain vLLM and 1A:1F, two repeats in ABBA order (plain, 1A1F, 1A1F,
plain) through the session's Serve proxy; `--no-redeploy` keeps the 1A:1F deployment
for both its repeats (3 deployments, not 4: a deployment is most of this test's
time); each measured round lasts at least `--min-round-s` (streams keep sending until
then). Checks that the result JSON is
complete, its figures positive, the runs paired by repeat, and the commit recorded;
performance itself is proven in benchmarks, never asserted here. The run streams
3 tokens per chunk (`--stream-interval 3`): both engines must honour it.

The 1A:1F rounds are traced (`--device-trace-steps`, through the product path: vLLM's
engine profiler on the attention rank, `DeviceTrace` on the FFN rank): each measured
round's merged trace holds both processes' events over one window. Two requests per
stream give every round more than `DELAY_STEPS` + `TRACE_STEPS` steps.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from afd_ray.bench import BenchResult
from afd_ray.bench.cli import main
from afd_ray.bench.device_trace import DELAY_STEPS
from afd_ray.observability.device_trace import STEP, read_trace

MIN_ROUND_S = 0.5
MAX_TOKENS = 16
"""Enough that a request's tokens rarely all reach the client in one chunk (vLLM merges
the chunks a slow reader has not taken yet), which leaves its decode time unseen."""
TRACE_STEPS = 4
"""Decode steps traced in each measured 1A:1F round."""
assert 2 * MAX_TOKENS > DELAY_STEPS + TRACE_STEPS  # two requests per stream reach the traced window


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
        "--requests-per-stream",
        "2",
        "--device-trace-steps",
        str(TRACE_STEPS),
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

    for repeat in (0, 1):  # both 1A:1F rounds: the merged trace of both roles over one window
        _assert_both_roles_traced(tmp_path / "result-traces" / "bench-qwen3-moe-1a1f" / f"r{repeat}-b1.json")

    table = capsys.readouterr().out
    assert (
        "plain" in table
        and "1A1F" in table
        and "split a/w/f/i" in table
        and "c/ep ms" in table
        and "AFD/plain" in table
    )


def _assert_both_roles_traced(merged_path: Path) -> None:
    merged = read_trace(merged_path)
    processes = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"] if e.get("name") == "process_name"}
    ffn_pids = {pid for pid, name in processes.items() if name.startswith("FFN rank")}
    attention_pids = {pid for pid, name in processes.items() if name.startswith("attention rank")}
    assert ffn_pids and attention_pids, processes
    complete = [e for e in merged["traceEvents"] if e.get("ph") == "X"]
    ffn_steps = [e for e in complete if e["name"] == STEP]
    assert len(ffn_steps) == TRACE_STEPS and {e["pid"] for e in ffn_steps} <= ffn_pids
    # the attention engine's ops within the window of the FFN rank's traced steps
    start = min(e["ts"] for e in ffn_steps)
    end = max(e["ts"] + e["dur"] for e in ffn_steps)
    assert [e for e in complete if e["pid"] in attention_pids and start <= e["ts"] <= end]
