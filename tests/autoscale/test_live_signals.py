"""Live autoscaling signals of the shipped application (`deployments/afd.yaml`,
1A:1F on CPU, the session `client` fixture): vLLM's stats and the FFN counters reach
`/afd/status` as a `MetricsSnapshot`, and `afd-ray autoscale record` traces them."""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from afd_ray.autoscale.schema import MetricsSnapshot
from afd_ray.autoscale.trace import read_trace
from afd_ray.cli import main

POLICY = Path(__file__).parents[2] / "deployments" / "autoscale.yaml"
PROMPTS = ["The capital of France is", "One, two, three,", "Water boils at", "The sky is"]


def _metrics(client: httpx.Client) -> MetricsSnapshot:
    response = client.get("/afd/status")
    assert response.status_code == 200, response.text
    return MetricsSnapshot.model_validate(response.json()["metrics"])


def test_status_metrics_after_requests(client: httpx.Client) -> None:
    body = {"model": "smollm2", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        responses = list(pool.map(lambda p: client.post("/v1/completions", json=body | {"prompt": p}), PROMPTS))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    # Attention ranks report every second: a report taken while the last requests still
    # ran carries their TPOT and running > 0; the next one must show the idle engine.
    deadline = time.monotonic() + 10
    metrics = _metrics(client)
    while (metrics.tpot_p90_s == 0 or metrics.running_requests > 0) and time.monotonic() < deadline:
        time.sleep(0.5)
        metrics = _metrics(client)
    assert (metrics.attention_ranks, metrics.ffn_ranks) == (1, 1)
    assert 0 < metrics.ttft_p90_s < 60
    assert 0 < metrics.tpot_p90_s < 10
    assert 0 < metrics.ffn_busy_fraction <= 1
    # prefill rows (the prompts) and one row per running request per decode step
    assert 1 <= metrics.tokens_per_ffn_step <= 4 * 16
    assert metrics.output_tokens_per_s > 0
    # all requests finished: the engine is idle, its gauges must not stay at their last values
    assert (metrics.running_requests, metrics.waiting_requests, metrics.kv_cache_usage) == (0, 0, 0)


def test_record_writes_a_trace_of_the_live_app(
    serve_url: str, client: httpx.Client, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.jsonl"
    args = [
        "autoscale",
        "record",
        "--url",
        serve_url,
        "--out",
        str(trace),
        "--interval-s",
        "0.5",
        "--duration-s",
        "1.6",
    ]
    assert main(args) == 0
    snapshots = read_trace(trace)
    assert len(snapshots) == 4  # at 0, 0.5, 1.0, 1.5 s
    assert all((s.attention_ranks, s.ffn_ranks) == (1, 1) for s in snapshots)
    times = [s.time_s for s in snapshots]
    assert all(a < b for a, b in itertools.pairwise(times))  # one poll after another, not the same snapshot
    # the recorded trace replays through the shipped policy: an idle 1A:1F stays at the minimum
    png = tmp_path / "trace.png"
    assert main(["autoscale", "simulate", "--policy", str(POLICY), "--trace", str(trace), "--plot", str(png)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG")
    assert "4 evaluations, 0 changes; final A=1 F=1" in capsys.readouterr().out
