"""Deploy each topology in turn, drive the load through Serve's HTTP proxy, collect.

Per family, `config.repeats` times, each topology in counterbalanced order (listed
order on even repeats, reversed on odd ones: plain, 1A1F, 1A1F, plain, ...): `serve.run`
the application under its own route prefix; per batch, send one unmeasured warm-up
round (one request per stream), read `/afd/status` once the FFN counters have
settled, run the measured load (at least `config.min_round_s` long), read the settled
counters again; then delete the application. The FFN figures are the deltas of the
two reads, so the engines' start-up and warm-up forwards are not counted. Every
repeat is a fresh deployment (the spread over repeats then includes what changes from
one start of the engines to the next), unless `config.redeploy` is off: then a layout
that runs twice in a row (at an ABBA turn) keeps its deployment for both repeats.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from datetime import UTC, datetime
from pathlib import Path

import httpx
import ray
import torch
import vllm
from ray import serve
from tqdm import tqdm
from vllm.platforms import current_platform

from afd_ray.bench.compare import compare
from afd_ray.bench.ffn_ranks import ffn_rank_result
from afd_ray.bench.config import BenchConfig, Topology
from afd_ray.bench.device_trace import device_trace, traced
from afd_ray.bench.load import LoadResult, run_load
from afd_ray.bench.plain import build_plain_app
from afd_ray.bench.schema import (
    BenchResult,
    Latency,
    Machine,
    RunResult,
    TransportResult,
)
from afd_ray.bench.slo import slo_result
from afd_ray.bench.transport import run as run_transport_microbench
from afd_ray.config import (
    AFDConfig,
    AttentionPoolConfig,
    ConnectorConfig,
    FFNPoolConfig,
    IngressConfig,
    ModelConfig,
    ObservabilityConfig,
)
from afd_ray.control.membership import AFDStatus
from afd_ray.models.embedded import prepare_smollm2, prepare_smollm2_moe
from afd_ray.models.shapes import SHAPES, build_shape
from afd_ray.models.tiny import build_tiny
from afd_ray.serve.app import build_app

__all__ = ["app_name", "deployments", "machine", "run_benchmark"]

SERVED_NAME = "tiny"
_SETTLE_POLL_S = 0.5
"""Gap between two `/afd/status` reads that must agree before counters count as
settled; longer than the FFN ranks' report period (0.2 s)."""
_SETTLE_READS = 20
"""Status reads before giving up on settled counters."""


def machine() -> Machine:
    """The CPU, memory, GPU (if CUDA is available) and software versions of this machine.

    The GPU's name comes from NVML through vLLM's platform (`current_platform`), which
    neither initializes CUDA in this process nor connects it to the MPS server: at the
    end of a 2026-12-07 H100 run, `torch.cuda.get_device_name` failed there ("MPS server
    is not ready to accept new MPS client requests", as the deleted replicas' clients
    went away) and the whole result was lost."""
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = next(
        (line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
        "unknown",
    )
    meminfo = Path("/proc/meminfo").read_text().split()
    mem_kib = int(meminfo[meminfo.index("MemTotal:") + 1])
    return Machine(
        cpu_model=model,
        logical_cores=os.cpu_count() or 0,
        usable_cores=len(os.sched_getaffinity(0)),
        memory_gib=round(mem_kib / (1 << 20), 1),
        os=platform.platform(),
        python=sys.version.split()[0],
        torch=torch.__version__,
        vllm=vllm.__version__,
        ray=ray.__version__,
        gpu=current_platform.get_device_name(0) if current_platform.is_cuda() else None,
    )


def _app_config(cfg: BenchConfig, family: str, checkpoint: Path, topology: Topology) -> AFDConfig:
    """The `AFDConfig` of one run; plain vLLM uses its model and attention sections.

    On `cuda` every member's bundle (and the plain engine's) is `cfg.gpu_fraction` GPU.
    The ingress holds more requests than the admission capacity at the largest batch
    (`AFDConfig` refuses less)."""
    plain = topology.ffn == 0
    threads = cfg.plain_threads if plain else cfg.attention_threads
    cuda = cfg.platform == "cuda"
    bundle = cfg.gpu_fraction if cuda else cfg.bundle_cpus
    memory = cfg.plain_gpu_memory_utilization if plain else cfg.gpu_memory_utilization
    batch = max(cfg.concurrency)
    ingress = IngressConfig()
    # the ingress must hold more than the admission capacity (`AFDConfig` checks it)
    ongoing = max(ingress.max_ongoing_requests, topology.attention * (batch + ingress.max_queued_per_rank) + 1)
    return AFDConfig(
        platform=cfg.platform,
        model=ModelConfig(
            source=str(checkpoint),
            served_name=SERVED_NAME,
            max_model_len=cfg.max_model_len,
            dtype=cfg.dtype,
            load_format="dummy" if family in SHAPES else "auto",
            quantization=cfg.quantization,
        ),
        attention=AttentionPoolConfig(
            num_ranks=topology.attention,
            bundle_resources=bundle,
            kv_cache_gib=cfg.kv_cache_gib,
            max_num_seqs=batch,
            stream_interval=cfg.stream_interval,
            num_threads=threads,
            **(
                {
                    "gpu_memory_utilization": memory,
                    "enforce_eager": cfg.enforce_eager,
                    "cudagraph_mode": topology.cudagraph_mode,
                }
                if cuda
                else {}
            ),
        ),
        ffn=FFNPoolConfig(
            num_ranks=topology.ffn, bundle_resources=bundle, num_threads=cfg.ffn_threads, ubatches=topology.ubatches
        )
        if topology.ffn
        else FFNPoolConfig(),
        connector=ConnectorConfig(transport=cfg.transport, batch_window_us=cfg.batch_window_us),
        ingress=IngressConfig(max_ongoing_requests=ongoing),
        observability=ObservabilityConfig()
        if topology.observability
        else ObservabilityConfig(metrics=False, step_records=0),
    )


def _checkpoint(cfg: BenchConfig, family: str) -> Path:
    """The folder of `family`: the embedded SmolLM2 (or its MoE), a model shape
    (config and tokenizer only), or a tiny one."""
    if family in SHAPES:
        return build_shape(family, cfg.checkpoints / family)
    if family == "smollm2":
        return prepare_smollm2()
    if family == "smollm2-moe":
        return prepare_smollm2_moe()
    return build_tiny(family, cfg.checkpoints / f"{family}-seed{cfg.seed}", cfg.seed)


def _settled_status(http: httpx.Client, route: str) -> AFDStatus:
    """`/afd/status` once two reads `_SETTLE_POLL_S` apart agree (all FFN counters
    reported), apart from `metrics` and `admission`, snapshots taken at each read.

    Raises:
        TimeoutError: the counters kept changing for `_SETTLE_READS` reads.
    """
    last = None
    for _ in range(_SETTLE_READS):
        response = http.get(f"{route}/afd/status")
        response.raise_for_status()
        status = AFDStatus.model_validate(response.json())
        per_read = {"metrics": None, "admission": None}  # snapshots taken at each read
        if last is not None and status.model_copy(update=per_read) == last.model_copy(update=per_read):
            return status
        last = status
        time.sleep(_SETTLE_POLL_S)
    raise TimeoutError(f"{route}/afd/status: FFN counters still changing after {_SETTLE_READS} reads")


def app_name(family: str, topology: Topology) -> str:
    """The Serve application (and route prefix, with a leading `/`) of one run."""
    return f"bench-{family}-{topology.label}".lower().replace("_", "-")


def _prompts(cfg: BenchConfig, checkpoint: Path, streams: int) -> list[str | list[int]]:
    """The prompt of each stream: `cfg.prompt` for all, or with `cfg.prompt_tokens`
    that many token ids per stream, drawn from the vocabulary (ids 2 and up, past
    bos/eos) by a generator seeded with `(cfg.seed, stream)`: distinct per stream and
    the same in every run."""
    if cfg.prompt_tokens is None:
        return [cfg.prompt] * streams
    vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
    return [
        random.Random(f"{cfg.seed}-{stream}").choices(range(2, vocab), k=cfg.prompt_tokens) for stream in range(streams)
    ]


def _run_one(
    cfg: BenchConfig,
    family: str,
    checkpoint: Path,
    topology: Topology,
    base_url: str,
    repeats: list[int],
    trace_dir: Path | None,
) -> list[RunResult]:
    """Deploy `topology`; for each of `repeats`, measure one load per `cfg.concurrency`
    value (an AFD one traced into `trace_dir` with `cfg.device_trace_steps`); delete it."""
    app_cfg = _app_config(cfg, family, checkpoint, topology)
    name = app_name(family, topology)
    tracing = trace_dir is not None and cfg.device_trace_steps > 0 and topology.ffn > 0
    if tracing:
        app_cfg = traced(app_cfg, trace_dir / name, cfg.device_trace_steps)
    route = f"/{name}"
    app = build_plain_app(app_cfg) if topology.ffn == 0 else build_app(app_cfg.model_dump())
    prompts = _prompts(cfg, checkpoint, max(cfg.concurrency))
    body = {"model": SERVED_NAME, "max_tokens": cfg.max_tokens, "temperature": 0, "ignore_eos": True}

    def load(concurrency: int, requests_per_stream: int, min_round_s: float) -> LoadResult:
        bodies = [body | {"prompt": prompt} for prompt in prompts[:concurrency]]
        path = f"{route}/v1/completions"
        return asyncio.run(run_load(base_url, path, bodies, requests_per_stream, cfg.request_timeout_s, min_round_s))

    start = time.perf_counter()
    serve.run(app, name=name, route_prefix=route)
    deploy_s = time.perf_counter() - start
    measured: list[tuple[int, int, LoadResult, AFDStatus, AFDStatus, tuple[float, float]]] = []
    try:
        with httpx.Client(base_url=base_url, timeout=cfg.request_timeout_s) as http:
            for repeat, concurrency in ((r, c) for r in repeats for c in cfg.concurrency):
                load(concurrency, 1, 0.0)  # warm-up (and prefix cache fill), not measured
                before = _settled_status(http, route)
                load_before = os.getloadavg()[0]
                trace_name = f"r{repeat}-b{concurrency}"
                with (
                    device_trace(name, trace_dir / name, cfg.device_trace_steps, trace_name)
                    if tracing
                    else nullcontext()
                ):
                    result = load(concurrency, cfg.requests_per_stream, cfg.min_round_s)
                load_after = os.getloadavg()[0]
                after = _settled_status(http, route)
                measured.append((repeat, concurrency, result, before, after, (load_before, load_after)))
    finally:
        serve.delete(name)

    model_config = json.loads((checkpoint / "config.json").read_text())
    layers, hidden = model_config["num_hidden_layers"], model_config["hidden_size"]
    elem = getattr(torch, app_cfg.model.dtype).itemsize
    runs = []
    for repeat, concurrency, result, before, after, load_average in measured:
        ffn = [
            ffn_rank_result(b, a, result.wall_s, layers, hidden, elem)
            for b, a in zip(before.ffn, after.ffn, strict=True)
        ]
        requests = result.requests
        output_tokens = sum(r.output_tokens for r in requests)
        runs.append(
            RunResult(
                family=family,
                topology=topology,
                label=topology.label,
                concurrency=concurrency,
                repeat=repeat,
                layers=layers,
                threads=app_cfg.attention.num_threads * topology.attention + app_cfg.ffn.num_threads * topology.ffn,
                deploy_s=deploy_s,
                requests=len(requests),
                output_tokens=output_tokens,
                prompt_tokens=requests[0].prompt_tokens,
                wall_s=result.wall_s,
                output_tokens_per_s=output_tokens / result.wall_s,
                decode_tokens_per_s=result.decode_tokens_per_s,
                ttft=Latency.of([r.ttft_s for r in requests]),
                tpot=Latency.of([r.tpot_s for r in requests]),
                itl=Latency.of([gap for r in requests for gap in r.itl_s]),
                e2e=Latency.of([r.e2e_s for r in requests]),
                load_average_1m=load_average,
                ffn=ffn,
                measured_bytes_per_step=sum(r.a2f_bytes_per_step + r.f2a_bytes_per_step for r in ffn) if ffn else None,
                formula_bytes_per_step=sum(r.formula_bytes_per_step for r in ffn) if ffn else None,
                slo=slo_result(
                    [r.ttft_s for r in requests],
                    [r.tpot_s for r in requests],
                    result.wall_s,
                    output_tokens,
                    topology.attention + topology.ffn,
                    cfg.slo_ttft_ms,
                    cfg.slo_tpot_ms,
                    cfg.price_per_device_hour,
                ),
            )
        )
    return runs


def deployments(cfg: BenchConfig) -> list[tuple[Topology, list[int]]]:
    """The deployments of one family, in order: (layout, the repeats it measures).
    Layouts run as listed on even repeats and reversed on odd ones (ABBA); without
    `cfg.redeploy`, a layout that runs twice in a row is one deployment."""
    out: list[tuple[Topology, list[int]]] = []
    for repeat in range(cfg.repeats):
        for topology in cfg.topologies if repeat % 2 == 0 else cfg.topologies[::-1]:
            if not cfg.redeploy and out and out[-1][0] == topology:
                out[-1][1].append(repeat)
            else:
                out.append((topology, [repeat]))
    return out


def run_benchmark(
    cfg: BenchConfig,
    base_url: str,
    progress: Callable[[str], None] = print,
    commit: str | None = None,
    partial: Callable[[BenchResult], None] | None = None,
    trace_dir: Path | None = None,
) -> BenchResult:
    """Measure every (family, topology) of `cfg`, `cfg.repeats` times in
    counterbalanced order, on the Serve instance at `base_url`; `commit` is recorded
    (`BenchResult.commit`). `partial`, if given, gets the result so far after every
    deployment, without `same_batch` (the CLI writes it, so a run cut by a time limit
    keeps its finished deployments' runs). With `cfg.device_trace_steps`, each measured
    AFD round leaves a merged device trace in `trace_dir` (`afd_ray.bench.device_trace`).

    Needs a Ray connection (`ray.init`) to a cluster whose Serve HTTP proxy answers at
    `base_url`, with room for the largest topology's bundles
    (`cfg.bundle_cpus` × (A + F) CPUs). Applications are named `bench-<family>-<label>`
    and deleted after their run; other applications are left alone.

    Raises:
        afd_ray.bench.load.LoadError: a request failed.
        RuntimeError: an FFN rank served no step during a load.
        TimeoutError: FFN counters did not settle after a load.
    """
    host = machine()  # before any deployment: a record of this run's machine, not of its end
    transport = None
    if cfg.transport_microbench and cfg.platform == "cpu":
        progress("afd_ray.bench: transport round trips ...")
        transport = TransportResult.model_validate(run_transport_microbench())
    runs = []
    cases = len(cfg.families) * len(deployments(cfg))
    # A bar on a terminal only (tqdm's disable=None), and only for more than one deployment.
    with tqdm(total=cases, unit="layout", desc="afd_ray.bench", disable=None if cases > 1 else True) as bar:
        for family in cfg.families:
            checkpoint = _checkpoint(cfg, family)
            for topology, repeats in deployments(cfg):
                progress(f"afd_ray.bench: {family} {topology.label} repeats {repeats} of {cfg.repeats} ...")
                for run in _run_one(cfg, family, checkpoint, topology, base_url, repeats, trace_dir):
                    progress(
                        f"afd_ray.bench: {family} {topology.label} repeat {run.repeat} batch {run.concurrency}: "
                        f"{run.output_tokens_per_s:.1f} output tok/s, {run.decode_tokens_per_s:.1f} decode "
                        f"tok/s, TPOT p50 {run.tpot.p50_ms:.2f} ms, {run.wall_s:.1f} s"
                    )
                    runs.append(run)
                bar.update(1)
                if partial is not None:  # pairs may be incomplete yet: no same_batch
                    partial(_result(cfg, commit, host, runs, transport, paired=False))
    return _result(cfg, commit, host, runs, transport)


def _result(
    cfg: BenchConfig,
    commit: str | None,
    host: Machine,
    runs: list[RunResult],
    transport: TransportResult | None,
    paired: bool = True,
) -> BenchResult:
    return BenchResult(
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        commit=commit,
        machine=host,
        config=cfg,
        runs=list(runs),
        same_batch=compare(runs) if paired else [],
        transport=transport,
    )
