"""What serving costs per step on CPU, measured through the product path.

`afd-ray profile` times the engines' steps in processes of their own
(`afd_ray.plan.probe`); a client of the Serve app sees more. A request's tokens go
from the engine through vLLM's OpenAI layer in the engine's Serve replica, the
`Ingress` replica and the HTTP proxy to the client, one chunk per token
(`attention.stream_interval` 1), and on a small machine those processes take the
cores the engine's threads run on. Measured on 2 cores (SmolLM2, batch 8, 2026-12-07):
plain vLLM's engine step 128 ms, its TPOT through the app 187 ms; AFD 1A:1F's
modelled step 186 ms, through the app 251 ms: about the same 60-65 ms per step on
both sides, which a model of the engines alone misses (30% low).

`measure_serving` serves plain vLLM with the benchmark (`afd_ray.bench.runner.
run_benchmark`: the same Serve app, the same load generator) at the profile's
batches and records its TPOT p50 (`ServingPoint`); `afd_ray.plan.model` fits what it
adds over the engine's own step, T_serve(b), and adds it to both sides.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from afd_ray.plan.schema import ServingPoint

__all__ = ["SERVING_REQUESTS_PER_STREAM", "measure_serving", "serving_points"]

SERVING_REQUESTS_PER_STREAM = 2
"""Measured requests per stream at each batch (after one warm-up request per stream):
the TPOT p50 is over `batch × 2` requests."""


def serving_points(result: object, batches: Sequence[int] | None = None) -> list[ServingPoint]:
    """The `plain` runs of a benchmark result (`afd_ray.bench.BenchResult`) as
    `ServingPoint`s, one per batch (in `batches`, if given): the median of the runs'
    TPOT p50 at that batch, context = prompt + half the output.

    Raises:
        ValueError: no `plain` run (at those batches) in `result`.
    """
    runs: dict[int, list[object]] = {}
    for run in result.runs:
        if run.label == "plain" and (batches is None or run.concurrency in batches):
            runs.setdefault(run.concurrency, []).append(run)
    if not runs:
        raise ValueError(f"result: no plain vLLM runs at batches {list(batches or [])}")
    return [
        ServingPoint(
            batch=batch,
            context=same[0].prompt_tokens + result.config.max_tokens / 2,
            tpot_ms=statistics.median(run.tpot.p50_ms for run in same),
            load_average_1m=statistics.median(run.load_average_1m[0] for run in same),
        )
        for batch, same in sorted(runs.items())
    ]


def measure_serving(
    family: str,
    batches: Sequence[int],
    prompt_tokens: int,
    output_tokens: int,
    threads: int,
    dtype: str = "float32",
    serve_url: str | None = None,
) -> list[ServingPoint]:
    """Serve `family` (a tiny family, `smollm2` or `smollm2-moe`: a name the benchmark
    serves) as plain vLLM with `threads` threads through the Serve app, one deployment,
    and measure its TPOT at every batch (`serving_points`).

    Ray: this process's connection if there is one (then `serve_url` is Serve's HTTP
    address, or Serve is started on a free loopback port), else a private local
    cluster for the run (`afd_ray.bench.cli.serve_endpoint`).

    Raises:
        ValueError: a bad setting (names the field).
        afd_ray.bench.load.LoadError, TimeoutError: see `run_benchmark`.
    """
    from afd_ray.bench.cli import serve_endpoint
    from afd_ray.bench.config import BenchConfig
    from afd_ray.bench.runner import run_benchmark

    cfg = BenchConfig.model_validate(
        {
            "dtype": dtype,
            "families": [family],
            "topologies": ["plain"],
            "concurrency": list(batches),
            "prompt_tokens": prompt_tokens,
            "max_tokens": output_tokens,
            "requests_per_stream": SERVING_REQUESTS_PER_STREAM,
            "repeats": 1,
            "plain_threads": threads,
            "transport_microbench": False,
            "max_model_len": max(16, prompt_tokens + output_tokens + 8),
        }
    )
    with serve_endpoint(cfg, None, serve_url) as url:
        result = run_benchmark(cfg, url, progress=lambda _: None)
    return serving_points(result)
