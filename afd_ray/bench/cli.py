"""`python -m afd_ray.bench`: run the benchmark, write the JSON, print the table.

Where it runs:

- **As a Ray job** (`JobSubmissionClient(...).submit_job(entrypoint="python -m
  afd_ray.bench ...")`) or with `--ray-address`: Ray sets `RAY_ADDRESS` for a job's
  driver, so the run joins that cluster, and uses its Serve instance (started on a
  free loopback port if there is none yet; its HTTP address is read from the
  dashboard's Serve REST API otherwise).
- **In a process already connected to Ray** (a notebook, a test): that connection,
  and `--serve-url` if Serve is already running without a dashboard.
- **Otherwise**: a private local cluster (`RAY_AUTH_MODE=disabled`, no dashboard, Serve
  on a free loopback port behind HAProxy as `make serve`'s: `private_cluster_env`), shut
  down at the end.

`ray.init(address="auto")` is deliberately not the fallback: "auto" joins any Ray
instance it finds on the machine, including another user's throw-away test cluster.
Pass `--ray-address auto` to opt into that.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import date
from pathlib import Path

from pydantic import ValidationError

from afd_ray.argtypes import check_writable
from afd_ray.bench.commit import git_commit
from afd_ray.bench.config import BenchConfig, Topology
from afd_ray.bench.schema import BenchResult, FFNRankResult, Stat
from afd_ray.config import EMBEDDED_MODELS
from afd_ray.models import FAMILIES
from afd_ray.models.shapes import SHAPES
from afd_ray.serve.ingress_env import private_cluster_env, private_http_options

__all__ = ["RUN_FLAGS", "build_parser", "format_same_batch", "format_table", "main", "serve_endpoint", "usage_message"]

SMOKE = {
    "topologies": ("plain", "1A1F"),
    "concurrency": (1,),
    "requests_per_stream": 1,
    "repeats": 1,
    "max_tokens": 4,
    "transport_microbench": False,
}
"""`--smoke`: one short request per topology, plain and 1A:1F, one repeat; flags given
explicitly still win."""

_FLAG_TYPES: dict[str, dict[str, object]] = {
    "platform": {"choices": ("cpu", "cuda")},
    "dtype": {"choices": ("float32", "bfloat16", "float16")},
    "families": {"nargs": "+", "choices": (*FAMILIES, *EMBEDDED_MODELS, *SHAPES)},
    "topologies": {"nargs": "+", "metavar": "LAYOUT"},
    "concurrency": {"type": int, "nargs": "+"},
    "prompt_tokens": {"type": int},
    "requests_per_stream": {"type": int},
    "min_round_s": {"type": float},
    "repeats": {"type": int},
    "redeploy": {"action": argparse.BooleanOptionalAction},
    "prompt": {},
    "max_tokens": {"type": int},
    "attention_threads": {"type": int},
    "ffn_threads": {"type": int},
    "plain_threads": {"type": int},
    "bundle_cpus": {"type": float},
    "gpu_fraction": {"type": float},
    "gpu_memory_utilization": {"type": float},
    "plain_gpu_memory_utilization": {"type": float},
    "quantization": {"choices": ("fp8",)},
    "enforce_eager": {"action": argparse.BooleanOptionalAction},
    "kv_cache_gib": {"type": float},
    "stream_interval": {"type": int},
    "max_model_len": {"type": int},
    "transport": {"choices": ("auto", "shm", "gloo", "cuda_ipc")},
    "transport_microbench": {"action": argparse.BooleanOptionalAction},
    "batch_window_us": {"type": int},
    "device_trace_steps": {"type": int},
    "seed": {"type": int},
    "checkpoints": {"type": Path},
    "slo_ttft_ms": {"type": float},
    "slo_tpot_ms": {"type": float},
    "price_per_device_hour": {"type": float},
    "request_timeout_s": {"type": float},
    "note": {},
}
"""Command-line form of each `BenchConfig` field; defaults and help come from the model."""

RUN_FLAGS = ("out", "ray_address", "serve_url", "smoke", "commit")
"""Flags of `build_parser` that are not `BenchConfig` fields: where the run connects,
where it writes, the preset, and the commit it records."""


def _shown(default: object) -> str:
    if isinstance(default, tuple):
        return " ".join(item.label if isinstance(item, Topology) else str(item) for item in default)
    return repr(default)


def build_parser() -> argparse.ArgumentParser:
    """The parser; `BenchConfig` fields left out keep the model's defaults."""
    parser = argparse.ArgumentParser(
        prog="python -m afd_ray.bench",
        description="Benchmark: plain vLLM vs AFD topologies under a fixed concurrent load (CPU or CUDA).",
    )
    for name, options in _FLAG_TYPES.items():
        field = BenchConfig.model_fields[name]
        shown = "" if field.default_factory else f" (default: {_shown(field.default)})"
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            default=argparse.SUPPRESS,
            help=f"{field.description}{shown}",
            **options,
        )
    parser.add_argument("--smoke", action="store_true", help=f"smallest run: {SMOKE}")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("benchmarks/results") / f"cpu-{date.today().isoformat()}.json",
        help="result JSON (default: benchmarks/results/cpu-<date>.json, relative to the working directory)",
    )
    parser.add_argument(
        "--ray-address",
        default=os.environ.get("RAY_ADDRESS") or None,
        help="Ray cluster to join (default: $RAY_ADDRESS, set for Ray jobs; else a private local cluster)",
    )
    parser.add_argument("--serve-url", help="HTTP address of a running Serve instance (default: discovered)")
    parser.add_argument(
        "--commit",
        help="git commit of the code that runs, recorded in the result (default: git rev-parse HEAD of this "
        "checkout, -dirty with uncommitted changes; give it where the copy has no .git)",
    )
    return parser


def _split(rank: FFNRankResult) -> str:
    """`attention/wire/ffn/idle` mean ms per timed step of one FFN rank, or `-`."""
    split = rank.split
    if split is None:
        return "-"
    return f"{split.attention_ms:.2f}/{split.wire_ms:.2f}/{split.ffn_ms:.2f}/{split.idle_ms:.2f}"


def format_table(result: BenchResult) -> str:
    """One line per run: throughput, latencies, FFN traffic, busy fraction and step split."""
    header = (
        f"{'family':<18}{'layout':<10}{'batch':>6}{'rep':>4}{'thr':>4}{'tok/s':>9}{'dec tok/s':>10}{'TTFT p50':>10}"
        f"{'TPOT p50':>9}{'TPOT p90':>9}{'ITL p50':>9}"
        f"{'ITL p99':>9}{'tok/step':>10}{'B/step':>10}{'formula':>10}{'FFN busy':>10}{'good r/s':>10}{'cost/1M':>9}"
        f"  {'c/ep ms':<12}{'split a/w/f/i'}"
    )
    lines = [header, "-" * len(header)]
    for run in result.runs:
        if run.ffn:
            tokens = f"{sum(r.mean_tokens_per_step for r in run.ffn):.2f}"
            measured, formula = f"{run.measured_bytes_per_step:.0f}", f"{run.formula_bytes_per_step:.0f}"
            busy = "/".join(f"{r.busy_fraction:.2f}" for r in run.ffn)
            split = " ".join(_split(r) for r in run.ffn)
            ranks = " ".join(f"{r.compute_ms_per_step:.2f}/{r.ep_ms_per_step:.2f}" for r in run.ffn)
        else:
            tokens = measured = formula = busy = split = ranks = "-"
        lines.append(
            f"{run.family:<18}{run.label:<10}{run.concurrency:>6}{run.repeat:>4}{run.threads:>4}"
            f"{run.output_tokens_per_s:>9.1f}{_number(run.decode_tokens_per_s):>10}{run.ttft.p50_ms:>10.1f}"
            f"{run.tpot.p50_ms:>9.1f}{run.tpot.p90_ms:>9.1f}{run.itl.p50_ms:>9.1f}{run.itl.p99_ms:>9.1f}"
            f"{tokens:>10}{measured:>10}{formula:>10}{busy:>10}"
            + (
                f"{run.slo.goodput_rps:>10.2f}{run.slo.cost_per_1m_output_tokens:>9.2f}"
                if run.slo
                else f"{'-':>10}{'-':>9}"
            )
            + f"  {ranks:<12}{split}"
        )
    lines.append(
        "batch: concurrent streams; rep: repeat; tok/s: output tokens over the round's wall time; dec tok/s: "
        "decode tokens/s (first token's wait left out); times in ms (TPOT: per request, percentiles over requests); tok/step and B/step (A2F+F2A) summed over FFN "
        "ranks; formula = 2 x L x N_tokens x H x bytes; FFN busy per rank; good r/s: requests/s "
        f"meeting TTFT <= {result.config.slo_ttft_ms:g} ms and TPOT <= {result.config.slo_tpot_ms:g} ms; "
        f"cost/1M: per 1M output tokens at {result.config.price_per_device_hour:g} per device-hour; "
        "c/ep ms per FFN rank: its own compute and its EP collectives per step (the straggler has the most "
        "compute); split a/w/f/i per FFN rank: mean ms per timed step of attention/wire/FFN/idle on the FFN rank's device timeline"
    )
    return "\n".join(lines)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _stat(stat: Stat, digits: int) -> str:
    return f"{stat.median:.{digits}f} [{stat.min:.{digits}f}..{stat.max:.{digits}f}]"


_FIGURE_NAMES = {
    "output_tok_s": "output tok/s",
    "decode_tok_s": "decode tok/s",
    "tpot_p50_ms": "TPOT p50 ms",
    "tpot_p90_ms": "TPOT p90 ms",
    "ttft_p50_ms": "TTFT p50 ms",
}


def format_same_batch(result: BenchResult) -> str:
    """Every AFD layout against plain vLLM at the same batch (`result.same_batch`):
    per figure, each side's median over the repeats and the median of the per-repeat
    AFD/plain ratios, each with its range; "" when the result has no plain runs."""
    if not result.same_batch:
        return ""
    header = f"{'family':<18}{'layout':<10}{'batch':>6}{'n':>3}  {'figure':<14}{'plain':<26}{'AFD':<26}AFD/plain"
    lines = [header, "-" * (len(header) + 12)]
    for c in result.same_batch:
        for k, (name, title) in enumerate(_FIGURE_NAMES.items()):
            key = f"{c.family:<18}{c.layout:<10}{c.batch:>6}{c.repeats:>3}" if k == 0 else " " * 37
            plain, afd, ratio = (getattr(side, name) for side in (c.plain, c.afd, c.ratio))
            lines.append(f"{key}  {title:<14}{_stat(plain, 1):<26}{_stat(afd, 1):<26}{_stat(ratio, 3)}")
    lines.append(
        "same batch against same batch; n: repeats of each side (ABBA order); median [min..max] over the repeats; "
        "AFD/plain: median [min..max] of the ratio of each repeat's pair"
    )
    return "\n".join(lines)


def usage_message(error: ValueError) -> str:
    """The usage error of a bad flag, one line: for a `BenchConfig` validation error,
    the first error of each field as `--flag: message (got value)` (a list flag whose
    every item failed also fails its length check: that second error is left out);
    any other `ValueError` as is."""
    if not isinstance(error, ValidationError):
        return str(error)
    lines: dict[object, str] = {}
    for item in error.errors():
        field = item["loc"][0] if item["loc"] else None
        if item["type"] == "value_error":
            message = str(item["ctx"]["error"])
        else:
            message = f"{item['msg']} (got {item['input']!r})"
        lines.setdefault(field, f"--{str(field).replace('_', '-')}: {message}" if field is not None else message)
    return "; ".join(lines.values())


def _local_cpus(cfg: BenchConfig) -> int:
    """Ray CPUs of a private cluster: the cores, or more if the largest topology's
    bundles need more scheduling units (the cores are then shared)."""
    needed = max(cfg.bundle_cpus * (t.attention + t.ffn) for t in cfg.topologies)
    return max(os.cpu_count() or 1, math.ceil(needed))


def _serve_url(dashboard_url: str | None) -> str:
    """Start Serve on a free loopback port (a no-op if it runs) and return its URL;
    with a dashboard, the URL of the Serve instance actually running."""
    import httpx
    from ray import serve

    http = private_http_options()
    serve.start(http_options=http)
    if not dashboard_url:
        return f"http://{http.host}:{http.port}"
    scheme = "" if "://" in dashboard_url else "http://"
    details = httpx.get(f"{scheme}{dashboard_url}/api/serve/applications/", timeout=30).raise_for_status().json()
    host, port = details["http_options"]["host"], details["http_options"]["port"]
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"


@contextmanager
def serve_endpoint(cfg: BenchConfig, ray_address: str | None, serve_url: str | None) -> Iterator[str]:
    """Connect to Ray as the module docstring says; yield the Serve HTTP URL."""
    import ray
    from ray import serve

    private = not ray.is_initialized() and ray_address is None
    joined = not ray.is_initialized()
    if private:
        os.environ["RAY_AUTH_MODE"] = "disabled"  # read by ray.init; loopback-only cluster
        os.environ.update(private_cluster_env())  # Serve's HTTP ingress as `make serve`'s
        context = ray.init(address="local", include_dashboard=False, num_cpus=_local_cpus(cfg))
    else:
        context = ray.init(address=ray_address, ignore_reinit_error=True)
    try:
        yield serve_url or _serve_url(context.dashboard_url)
    finally:
        if private:
            serve.shutdown()
        if joined:
            ray.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; `argv` defaults to `sys.argv[1:]`. Returns 0.

    Bad flags exit with status 2 and a message naming the field.
    """
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    out, ray_address, serve_url, smoke, commit = (args.pop(k) for k in RUN_FLAGS)
    commit = commit or git_commit()
    try:
        cfg = BenchConfig.model_validate((SMOKE if smoke else {}) | args)
    except ValueError as e:
        parser.error(usage_message(e))
    try:
        check_writable(out)
    except ValueError as e:
        parser.error(str(e))

    from afd_ray.bench.runner import run_benchmark
    from afd_ray.bench.transport import format_table as format_transport_table

    def write(result: BenchResult) -> None:
        out.write_text(result.model_dump_json(indent=2) + "\n")

    with serve_endpoint(cfg, ray_address, serve_url) as url:
        traces = out.with_name(f"{out.stem}-traces") if cfg.device_trace_steps else None
        result = run_benchmark(cfg, url, commit=commit, partial=write, trace_dir=traces)
    write(result)
    print(format_table(result))
    if result.same_batch:
        print(format_same_batch(result))
    if result.transport is not None:
        print(format_transport_table(result.transport.model_dump()))
    print(f"afd_ray.bench: wrote {out}")
    return 0
