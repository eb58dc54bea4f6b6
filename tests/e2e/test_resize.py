"""Resizing A:F while serving, through the real application under continuous load.

A tiny random Qwen3-MoE (float32, 8 experts, so an FFN resize really reshards the
experts) runs 1A:1F -> 2A:1F -> 2A:2F -> 1A:2F -> 1A:1F while three client threads
stream greedy completions without pause. Every request must finish with exactly the
tokens plain vLLM gives its prompt (none lost, cut, repeated or duplicated); each
resize is reported with its epoch, members' states, longest FFN step-boundary pause
and weight bytes loaded, and the client-side longest gap between two tokens during
the resize is measured too.

A real Prometheus (Debian's package) scrapes the cluster through Ray's own
service-discovery file for the whole module; the last test checks that every `afd_*`
metric and every panel query of `dashboards/afd.json` has nonzero data in it.
"""

from __future__ import annotations

import gc
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from ray import serve

from afd_ray.cli import main as cli
from afd_ray.models.tiny import build_tiny
from afd_ray.observability.dashboards import RATE
from afd_ray.observability.metrics import METRICS, Kind
from afd_ray.serve.app import build_app
from prom_server import Prometheus, write_ray_service_discovery

NAME = "resize"
PREFIX = f"/{NAME}"
PROMPTS = ["The quick brown fox", "def main():", "Hello, my name is", "import os"]
MAX_TOKENS = 12
STREAMS = 3
LAYOUTS = [(2, 1), (2, 2), (1, 2), (1, 1)]
DRAIN_TIMEOUT_S = 5
DECIDE_WITHIN_S = 60
"""The policy scales out after 5 s above its threshold, evaluated every second."""
RESIZE_TIMEOUT_S = 600
"""`autoscale.resize_timeout_s` of the app."""
MAX_MODEL_LEN = 1024
LONG_TOKENS = 1000
"""A request that outlives the drain timeout (10-20 ms per token here)."""


def _plain_vllm_tokens(checkpoint: Path) -> list[list[int]]:
    """Greedy tokens of plain vLLM (no AFD) for `PROMPTS`, in-process engine, the
    first `MAX_TOKENS` of them; a last entry with `LONG_TOKENS` for `PROMPTS[0]`."""
    from vllm import LLM, SamplingParams

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        llm = LLM(
            str(checkpoint),
            dtype="float32",
            enforce_eager=True,
            max_model_len=MAX_MODEL_LEN,
            kv_cache_memory_bytes=1 << 28,
        )
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        tokens = [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, params, use_tqdm=False)]
        long = SamplingParams(temperature=0, max_tokens=LONG_TOKENS, ignore_eos=True)
        (out,) = llm.generate(PROMPTS[:1], long, use_tqdm=False)
        tokens.append(list(out.outputs[0].token_ids))
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    finally:
        del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
    return tokens


@dataclass
class _Result:
    prompt: int
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    """Arrival time of each token, monotonic seconds."""
    error: str | None = None


def _stream(http: httpx.Client, prompt: int, max_tokens: int = MAX_TOKENS) -> _Result:
    """One streamed greedy completion of `PROMPTS[prompt]`."""
    result = _Result(prompt)
    body = {
        "model": "tiny",
        "prompt": PROMPTS[prompt],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    with http.stream("POST", f"{PREFIX}/v1/completions", json=body) as response:
        if response.status_code != 200:
            result.error = f"{response.status_code}: {response.read().decode()}"
            return result
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                result.error = event["error"]["message"]
                continue
            ids = event["choices"][0].get("token_ids") or []
            result.tokens += ids
            result.times += [time.monotonic()] * len(ids)
    return result


class _Load:
    """`STREAMS` threads that each stream completions back to back until `stop()`."""

    def __init__(self, http: httpx.Client) -> None:
        self.results: list[_Result] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(http, i)) for i in range(STREAMS)]
        for thread in self._threads:
            thread.start()

    def _run(self, http: httpx.Client, stream: int) -> None:
        n = stream
        while not self._stop.is_set():
            self.results.append(_stream(http, n % len(PROMPTS)))
            n += STREAMS

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(300)

    def max_gap_s(self, start: float, end: float) -> float:
        """Longest time between two consecutive tokens of one request, among tokens
        that arrived in `[start, end]` (monotonic seconds)."""
        gaps = [b - a for r in self.results for a, b in zip(r.times, r.times[1:]) if start <= b <= end]
        return max(gaps, default=0.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    path = Path(build_tiny("qwen3_moe", tmp_path_factory.mktemp("resize") / "qwen3_moe"))
    return path, _plain_vllm_tokens(path)


POLICY = """
attention:
  min_ranks: 1
  max_ranks: 2
  scale_out_after_s: 5
  scale_in_after_s: 3600
  scale_in_cooldown_s: 3600
  signals:
    running_per_rank: {scale_out: 0.5, scale_in: 0.1}
ffn:
  min_ranks: 1
  max_ranks: 2
"""
"""Grows the attention pool once requests run on its rank for 5 s (more than 0.5 per
rank at every report); never shrinks it, never changes the FFN pool (no FFN signal).
The bound was 1.5 until the attention rank's engine lost its worker process: with
`STREAMS` back-to-back streams of `MAX_TOKENS` tokens the autoscaler then decided
nothing in 60 s on a quiet 2-core machine. A faster step leaves each stream's request
running for less of its cycle (the next request waits for its HTTP round trip), so
some reports can show fewer than 2 running, and each restarts the policy's 5 s hold."""


@pytest.fixture(scope="module")
def prometheus(ray_cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """A real Prometheus scraping the session cluster, started before the application."""
    server = Prometheus(write_ray_service_discovery(), tmp_path_factory.mktemp("prometheus"))
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def http(
    serve_url: str,
    checkpoint: tuple[Path, list[list[int]]],
    tmp_path_factory: pytest.TempPathFactory,
    prometheus: Prometheus,
) -> Iterator[httpx.Client]:
    policy = tmp_path_factory.mktemp("policy") / "autoscale.yaml"
    policy.write_text(POLICY)
    args = {
        "model": {"source": str(checkpoint[0]), "served_name": "tiny", "max_model_len": MAX_MODEL_LEN},
        "attention": {"num_ranks": 1, "max_ranks": 2, "kv_cache_gib": 0.25, "max_num_seqs": 8, "bundle_resources": 0.5},
        "ffn": {"num_ranks": 1, "max_ranks": 2, "bundle_resources": 0.5},
        "autoscale": {
            "drain_timeout_s": DRAIN_TIMEOUT_S,
            "resize_timeout_s": RESIZE_TIMEOUT_S,
            "enabled": True,
            "policy": str(policy),
            "interval_s": 1,
        },
    }
    serve.run(build_app(args), name=NAME, route_prefix=PREFIX, external_scaler_enabled=True)
    try:
        with httpx.Client(base_url=serve_url, timeout=600) as client:
            yield client
    finally:
        serve.delete(NAME, _blocking=False)  # the next module need not wait out its replicas' stop


def test_bad_scale_bodies_name_the_field(http: httpx.Client) -> None:
    for body, param in [
        ({"attention": 3, "ffn": 1}, "attention"),
        ({"attention": 1, "ffn": 0}, "ffn"),
        ({"attention": "two", "ffn": 1}, "attention"),
        ({"ffn": 1}, "attention"),
        ({"attention": 1, "ffn": 1, "extra": 1}, "extra"),
        # strict: never converted (a fresh user's `true` / "2" resized the pools)
        ({"attention": True, "ffn": 1}, "attention"),
        ({"attention": 1, "ffn": "2"}, "ffn"),
        ({"attention": 2.0, "ffn": 1}, "attention"),
    ]:
        response = http.post(f"{PREFIX}/afd/scale", json=body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param, (body, response.text)


def test_resizes_under_load_lose_no_request(
    http: httpx.Client, checkpoint: tuple[Path, list[list[int]]], serve_url: str
) -> None:
    expected = checkpoint[1]
    load = _Load(http)
    report = []
    try:
        time.sleep(2)  # the load is running before the first resize
        for attention, ffn in LAYOUTS:
            start = time.monotonic()
            if (attention, ffn) == LAYOUTS[0]:  # the CLI, once
                assert cli(["scale", "--attention", "2", "--ffn", "1", "--url", serve_url + PREFIX]) == 0
            elif (attention, ffn) == LAYOUTS[2]:  # a client that gives up: the resize still runs to its end
                resizes = len(http.get(f"{PREFIX}/afd/status").json()["resizes"])
                with pytest.raises(httpx.ReadTimeout):
                    http.post(f"{PREFIX}/afd/scale", json={"attention": attention, "ffn": ffn}, timeout=1)
                deadline = time.monotonic() + 300
                while len(http.get(f"{PREFIX}/afd/status").json()["resizes"]) == resizes:
                    assert time.monotonic() < deadline, "the abandoned resize never completed"
                    time.sleep(0.5)
            else:
                response = http.post(f"{PREFIX}/afd/scale", json={"attention": attention, "ffn": ffn})
                assert response.status_code == 200, response.text
            end = time.monotonic()
            status = http.get(f"{PREFIX}/afd/status").json()
            event = status["resizes"][-1]
            assert event["error"] is None, event
            assert (event["to_attention"], event["to_ffn"]) == (attention, ffn)
            ready = [m for m in status["attention"] if m["state"] == "ready"]
            assert len(ready) == attention, status["attention"]
            assert all(m["state"] in ("ready", "gone") for m in status["attention"] + status["ffn"])
            ffn_ready = [m for m in status["ffn"] if m["state"] == "ready"]
            assert len(ffn_ready) == ffn and sorted(m["ep_rank"] for m in ffn_ready) == list(range(ffn))
            assert all(m["epoch"] == ffn_ready[0]["epoch"] for m in ffn_ready)
            peers = {m["rank"]: 0 for m in ffn_ready}
            for m in ready:
                peers[m["ffn_peer"]] += 1  # every attention rank peers with a serving FFN rank
            assert max(peers.values()) - min(peers.values()) <= 1, peers  # balanced
            assert status["autoscale_paused"] is True
            report.append(
                (
                    f"{event['from_attention']}A:{event['from_ffn']}F -> {attention}A:{ffn}F",
                    event["epoch"],
                    event["duration_s"],
                    event["pause_s"],
                    event["bytes_loaded"],
                    load.max_gap_s(start, end),
                )
            )
            time.sleep(1)
    finally:
        load.stop()
    for row in report:
        name, epoch, duration, pause, loaded, gap = row
        print(
            f"resize {name}: epoch {epoch}, {duration:.1f} s, FFN pause {pause:.4f} s, "
            f"{loaded} weight bytes loaded, max ITL {gap:.3f} s"
        )
    epochs = [row[1] for row in report]
    # Only the FFN resizes (and the re-peering they bring) start new epochs; an
    # attention rank joins or leaves under the current one.
    assert epochs[0] == 0 and epochs[1] > epochs[0] and epochs[2] == epochs[1] and epochs[3] > epochs[2]
    assert report[1][4] > 0 and report[3][4] > 0  # FFN resizes loaded expert shards
    done = [r for r in load.results if r.error is None]
    assert [r.error for r in load.results if r.error is not None] == []
    assert len(done) >= 3 * len(LAYOUTS)
    for r in done:
        assert r.tokens == expected[r.prompt], f"prompt {r.prompt}: {r.tokens} != {expected[r.prompt]}"
    response = http.post(f"{PREFIX}/afd/autoscale/resume")
    assert response.json() == {"autoscale_paused": False, "autoscale_enabled": True}


def test_autoscaler_grows_the_attention_pool_under_load(
    http: httpx.Client, checkpoint: tuple[Path, list[list[int]]]
) -> None:
    """After `resume`, the coordinator's autoscaler (the `POLICY` above, evaluated every
    second) resizes 1A:1F -> 2A:1F on its own under three concurrent streams, with the
    policy's reason; requests stay exact.

    Two bounds: the decision (the attention target becomes 2) within `DECIDE_WITHIN_S`
    of the load, and the resize itself (a new vLLM engine starting beside the load: on
    CI's 2-core machine over 4 minutes) within the app's `autoscale.resize_timeout_s`."""
    assert http.post(f"{PREFIX}/afd/autoscale/resume").json() == {"autoscale_paused": False, "autoscale_enabled": True}
    before = len(http.get(f"{PREFIX}/afd/status").json()["resizes"])
    load = _Load(http)
    try:
        start = time.monotonic()
        while (status := http.get(f"{PREFIX}/afd/status").json())["target_attention"] == 1:
            assert time.monotonic() - start < DECIDE_WITHIN_S, status["metrics"]
            time.sleep(1)
        decided = time.monotonic()
        while len((status := http.get(f"{PREFIX}/afd/status").json())["resizes"]) == before:
            assert time.monotonic() - decided < RESIZE_TIMEOUT_S, status["attention"]
            time.sleep(1)
    finally:
        load.stop()
    resized_s = time.monotonic() - decided
    print(f"\nautoscaler: decided after {decided - start:.1f} s of load, resized {resized_s:.1f} s later")
    (event,) = status["resizes"][before:]
    assert event["error"] is None and (event["to_attention"], event["to_ffn"]) == (2, 1), event
    assert "running_per_rank" in event["reason"], event["reason"]
    assert [m["state"] for m in status["attention"]].count("ready") == 2
    assert all(r.error is None and r.tokens == checkpoint[1][r.prompt] for r in load.results)


def test_requests_beyond_the_drain_timeout_end_with_a_clear_error(
    http: httpx.Client, checkpoint: tuple[Path, list[list[int]]]
) -> None:
    """2A:1F (the autoscaler's, above) -> 1A:1F while long requests run on both ranks:
    those on the removed rank end, `DRAIN_TIMEOUT_S` later, with an SSE error event
    naming the drain timeout; the others finish with plain vLLM's tokens. No request is
    lost or hangs."""
    expected = checkpoint[1][-1]
    status = http.get(f"{PREFIX}/afd/status").json()
    assert [m["state"] for m in status["attention"]].count("ready") == 2
    results: list[_Result] = []
    threads = [threading.Thread(target=lambda: results.append(_stream(http, 0, LONG_TOKENS))) for _ in range(6)]
    for thread in threads:
        thread.start()
        time.sleep(0.2)  # Serve's router spreads them over both attention ranks
    time.sleep(1)  # all six are decoding
    response = http.post(f"{PREFIX}/afd/scale", json={"attention": 1, "ffn": 1})
    assert response.status_code == 200, response.text
    for thread in threads:
        thread.join(300)
    assert len(results) == 6
    failed = [r for r in results if r.error is not None]
    assert failed, "no request ran on the removed attention rank"
    for r in failed:
        assert "drain timeout" in r.error, r.error
        assert r.tokens == expected[: len(r.tokens)]  # what it got is right, nothing repeated
    for r in results:
        if r.error is None:
            assert r.tokens == expected
    status = http.get(f"{PREFIX}/afd/status").json()
    assert [m["state"] for m in status["attention"]].count("ready") == 1


DASHBOARD = Path(__file__).parents[2] / "dashboards" / "afd.json"
RATE_WINDOW = "1m"
"""Stands for Grafana's `$__rate_interval` (its default for Prometheus): 20 scrapes."""
SCRAPED_TIMEOUT_S = 90
"""Ray flushes a worker's metrics to the node's exporter every few seconds, and
Prometheus scrapes every 3 s: the last resizes' samples may arrive that late."""


def test_prometheus_has_every_afd_metric_and_every_panel(http: httpx.Client, prometheus: Prometheus) -> None:
    """Last in the module: the resizes under load above (manual and autoscaler, FFN
    resharding with EP2, 8 experts), as scraped by the real Prometheus. Every `afd_*`
    metric has a nonzero sample (a histogram: its `_count`), and every panel query of
    `dashboards/afd.json` (`$__rate_interval` = `RATE_WINDOW`) returns a series with a
    nonzero value over the module's time range, through Prometheus's HTTP API."""
    queries = {m.name: m.series + ("_count" if m.kind is Kind.HISTOGRAM else "") for m in METRICS}
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel["targets"]:
            queries[f"{panel['title']}: {target['expr']}"] = target["expr"].replace(RATE, RATE_WINDOW)
    deadline = time.monotonic() + SCRAPED_TIMEOUT_S
    while True:
        queries = {
            name: expr
            for name, expr in queries.items()
            if not prometheus.nonzero_series(expr, prometheus.started, time.time(), step_s=5)
        }
        if not queries or time.monotonic() > deadline:
            break
        time.sleep(5)
    targets = [(t["scrapeUrl"], t["health"], t["lastError"]) for t in prometheus.targets()]
    assert any(health == "up" for _, health, _ in targets), targets
    assert list(queries) == [], f"no nonzero data for {list(queries)}; targets {targets}"
