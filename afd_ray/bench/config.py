"""What one benchmark run measures: `BenchConfig`, built once from the command line.

Only the measured settings live here (they are recorded in the result JSON); where
the run connects (Ray address, Serve URL) and where it writes are CLI arguments.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from afd_ray.config import BATCH_WINDOW_MAX_US, AttentionPoolConfig, ConnectorConfig, CudaGraphMode, DType
from afd_ray.connector.transports import TransportChoice, check_transport
from afd_ray.models import Family
from afd_ray.models.shapes import Shape
from afd_ray.platform import collective_backend

Embedded = Literal["smollm2", "smollm2-moe"]
"""An embedded checkpoint (`afd_ray.models.embedded`), benchmarked like a family."""

__all__ = ["MAX_RANKS", "BenchConfig", "Topology"]

MAX_RANKS = 256
"""Most attention ranks, and most FFN ranks, of one benchmark layout. Each rank is a
Serve replica in a placement group of its own, and a layout is deployed whole; 256
is past any machine this bench runs on (a CPU host, an 8-GPU node), and keeps a typo
such as `--attention 1-100000000` a usage error rather than a sweep of 10^8 layouts."""

_TOPOLOGY = re.compile(r"(\d+)A(\d+)F(-dbo)?(-bare)?(-full|-piecewise)?", re.IGNORECASE)


class Topology(BaseModel):
    """One serving layout: `plain` (vLLM alone) or `<A>A<F>F` (AFD, EP=F); with the
    suffix `-dbo`, each FFN rank serves its attention peers in two ubatches per layer
    (`ffn.ubatches` 2, DBO across attention ranks), which needs at least two attention
    ranks per FFN rank (A >= 2F; with fewer an FFN rank's one peer is one ubatch, the
    same run as without `-dbo`; with F >= 2 on an MoE family, EP runs each step as one
    ubatch too); with `-bare`, AFD without metrics and step records
    (`observability.metrics` off, `observability.step_records` 0), to measure their
    cost in the same run; with CUDA graphs on, the attention engines run the default
    `attention.cudagraph_mode` (`full_decode`: whole decode steps captured), or
    piecewise graphs split at the FFN ops with `-piecewise` (`-full` names the
    default explicitly).

    Parses from its label, so `"plain"`, `"1A1F"`, `"2a2f"`, `"2A1F-dbo"`,
    `"1A1F-bare"`, `"1A1F-piecewise"` and `"1A1F-full"` are valid inputs.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    attention: int = Field(ge=1, le=MAX_RANKS)
    """Attention ranks (vLLM engines); 1 for plain vLLM."""
    ffn: int = Field(ge=0, le=MAX_RANKS)
    """FFN ranks (the EP size); 0 means plain vLLM, with no FFN pool."""
    ubatches: int = Field(1, ge=1)
    """`FFNPoolConfig.ubatches`: 2 with `-dbo`."""
    observability: bool = True
    """AFD with metrics and step records (the default), or without (`-bare`)."""
    cudagraph_mode: CudaGraphMode = AttentionPoolConfig().cudagraph_mode
    """`AttentionPoolConfig.cudagraph_mode`: its default, `piecewise` with `-piecewise`."""

    @model_validator(mode="before")
    @classmethod
    def _from_label(cls, data: object) -> object:
        if not isinstance(data, str):
            return data
        if data.lower() == "plain":
            return {"attention": 1, "ffn": 0}
        match = _TOPOLOGY.fullmatch(data)
        if match is None:
            raise ValueError(
                f"topology {data!r}: expected 'plain' or '<A>A<F>F[-dbo][-bare][-full|-piecewise]' with F >= 1 "
                "(e.g. 2A2F, 2A1F-dbo, 1A1F-bare, 1A1F-piecewise)"
            )
        attention, ffn = int(match[1]), int(match[2])
        for name, count in (("attention ranks A", attention), ("FFN ranks F", ffn)):
            if not 1 <= count <= MAX_RANKS:
                raise ValueError(f"topology {data!r}: {name} must be from 1 to {MAX_RANKS}, got {count}")
        graphs = {} if match[5] is None else {"cudagraph_mode": match[5][1:].lower().replace("full", "full_decode")}
        return {
            "attention": attention,
            "ffn": ffn,
            "ubatches": 2 if match[3] else 1,
            "observability": match[4] is None,
            **graphs,
        }

    @model_validator(mode="after")
    def _dbo_needs_two_peers(self) -> Topology:
        if self.ubatches > 1 and not 1 <= self.ffn <= self.attention // 2:
            raise ValueError(
                f"topology {self.label!r}: -dbo needs at least 2 attention ranks per FFN rank (A >= 2F, e.g. "
                "2A1F-dbo, 4A2F-dbo): each FFN rank splits its attention peers into 2 ubatches"
            )
        return self

    @property
    def label(self) -> str:
        """`plain` or `<A>A<F>F[-dbo][-bare][-piecewise]` (`-piecewise`: not the default graph mode)."""
        if self.ffn == 0:
            return "plain"
        return (
            f"{self.attention}A{self.ffn}F"
            + ("-dbo" if self.ubatches > 1 else "")
            + ("" if self.observability else "-bare")
            + ("" if self.cudagraph_mode == AttentionPoolConfig().cudagraph_mode else f"-{self.cudagraph_mode}")
        )


def _default_checkpoints() -> Path:
    from afd_ray.models.embedded import cache_dir

    return cache_dir() / "tiny"


TRACE_DELAY_STEPS = 16
"""Steps of a measured round before its device trace starts (past its prefills; each
side counts its own: the attention engine's `execute_model` calls, the FFN rank's
steps)."""


class BenchConfig(BaseModel):
    """The measured settings: models, layouts, the load and the pool sizes.

    Strict like the config tree's sections (`afd_ray.config`): unknown keys are
    refused, an integer field takes an integer (never `"4"` or `4.0`), a flag only
    `True`/`False`, and a float is finite. The lists (`families`, `topologies`,
    `concurrency`) take a list or a tuple, `checkpoints` a path or a string.
    """

    model_config = ConfigDict(
        frozen=True, extra="forbid", strict=True, allow_inf_nan=False, use_attribute_docstrings=True
    )

    platform: Literal["cpu", "cuda"] = "cpu"
    """Where the engines run. `cuda`: every pool member (and the plain engine) gets a
    `gpu_fraction` GPU bundle, so 1A:1F shares one GPU (`cuda_ipc` between the two;
    start the NVIDIA MPS daemon first, see deployments/afd-cuda.yaml)."""

    dtype: DType = "float32"
    """Parameter and activation dtype of every engine (`ModelConfig.dtype`)."""

    families: tuple[Family | Embedded | Shape, ...] = Field(("qwen3_moe",), min_length=1, strict=False)
    """Checkpoints to serve, one after another: tiny families (`afd_ray.models.tiny`),
    the embedded SmolLM2 (`smollm2`) and its MoE upcycling (`smollm2-moe`), or a real
    model's shape with random weights (`afd_ray.models.shapes`, `load_format: dummy`)."""

    topologies: tuple[Topology, ...] = Field(
        (Topology(attention=1, ffn=0), Topology(attention=1, ffn=1), Topology(attention=2, ffn=2)),
        min_length=1,
        strict=False,
    )
    """Layouts to deploy, one after another, for every family."""

    concurrency: tuple[Annotated[int, Field(strict=True, gt=0)], ...] = Field((4,), min_length=1, strict=False)
    """Concurrent request streams (the decode batch), one measured load per value on
    the same deployment, in the order given; each attention rank admits the largest."""

    prompt_tokens: int | None = Field(None, ge=1)
    """If set, stream `i` sends `prompt_tokens` token ids of its own (seeded, distinct
    per stream) instead of `prompt`; the warm-up round sends the same prompts, so the
    measured requests find them in vLLM's prefix cache: TTFT is then a cache hit,
    while every decode step still attends over the whole context of each sequence."""

    requests_per_stream: int = Field(4, ge=1)
    """Requests each stream sends one after another (measured), at least; see `min_round_s`."""

    min_round_s: float = Field(0.0, ge=0)
    """Seconds a measured round lasts at least: each stream keeps sending requests
    (past `requests_per_stream`) until this long after the round started, so the
    batch stays full and decode is measured over this long (10 on the GPU product
    benchmark, where 2 x 256 tokens per stream lasted 1-4 s); 0: `requests_per_stream`
    alone sizes the round."""

    repeats: int = Field(3, ge=1)
    """Deployments of every layout, each measured at every batch. The layouts run in
    counterbalanced (ABBA) order: the listed order on even repeats, reversed on odd
    ones (plain, 1A1F, 1A1F, plain, plain, 1A1F for 3 repeats), so a drift of the
    machine over the run does not always favour the side that runs later. Repeat k of
    each AFD layout is compared with repeat k of plain (`afd_ray.bench.compare`)."""

    redeploy: bool = True
    """Deploy a layout anew for every repeat, so the spread includes what changes from
    one start of the engines to the next; off, a layout that runs twice in a row (at
    an ABBA turn) keeps its deployment: R + 1 deployments of two layouts instead of
    2R (a GPU deployment takes 100-150 s)."""

    prompt: str = Field("The quick brown fox jumps over the lazy dog, again and again and again.", min_length=1)
    """The prompt of every request (the same for all, so prompt length is fixed)."""

    max_tokens: int = Field(64, ge=2)
    """Output tokens of every request (`ignore_eos`, so every request yields exactly
    this many); at least 2, so that a time per output token exists."""

    attention_threads: int = Field(1, ge=1)
    """Torch/OpenMP threads of each attention rank's engine."""

    ffn_threads: int = Field(1, ge=1)
    """Torch intra-op threads of each FFN rank."""

    plain_threads: int = Field(2, ge=1)
    """Torch/OpenMP threads of the plain vLLM engine; the default 2 equals the threads
    of 1A:1F (one attention thread plus one FFN thread)."""

    bundle_cpus: float = Field(0.5, gt=0)
    """Ray CPUs in each pool member's bundle (a scheduling unit, not a core pin); CPU only."""

    gpu_fraction: float = Field(0.5, gt=0, le=1)
    """CUDA only: GPUs in each pool member's bundle (and the plain engine's); 0.5 puts
    one attention rank and one FFN rank on one GPU."""

    gpu_memory_utilization: float = Field(0.45, gt=0, le=1)
    """CUDA only: `AttentionPoolConfig.gpu_memory_utilization` of the attention
    engines (free GPU memory they need at start, beside the FFN rank's experts)."""

    plain_gpu_memory_utilization: float = Field(0.8, gt=0, le=1)
    """CUDA only: the same for the plain engine, which holds the whole model."""

    quantization: Literal["fp8"] | None = None
    """`ModelConfig.quantization` of both sides: `fp8` runs plain vLLM with vLLM's
    dynamic FP8 (`quantization="fp8"`) and AFD with the same on the attention engine
    and FP8 routed experts on the FFN rank (CUDA with compute capability >= 8.9 only;
    `AFDConfig` refuses it elsewhere)."""

    enforce_eager: bool = True
    """CUDA only: eager engines (no torch.compile / CUDA graphs on the attention side)."""

    kv_cache_gib: float = Field(0.25, gt=0)
    """KV-cache space of each engine, GiB."""

    stream_interval: int = Field(1, ge=1)
    """`AttentionPoolConfig.stream_interval` of every engine, plain and AFD: output
    tokens per streamed chunk. TPOT stays exact (first to last token over the tokens
    between); ITL is then the gap between chunks of this many tokens."""

    max_model_len: int = Field(512, ge=16)
    """Context length of each engine, tokens (prompt + output)."""

    transport: TransportChoice = "auto"
    """`ConnectorConfig.transport` of the AFD runs (`auto`: `shm` on one node); a
    fixed one must carry the platform's tensors (`shm`/`gloo` on CPU, `cuda_ipc` on
    CUDA)."""

    batch_window_us: int = Field(ConnectorConfig().batch_window_us, ge=0, le=BATCH_WINDOW_MAX_US)
    """`ConnectorConfig.batch_window_us` of the AFD runs: how long an FFN rank waits
    for its other attention peers' step headers, microseconds; at most 100000
    (`afd_ray.config.BATCH_WINDOW_MAX_US`)."""

    transport_microbench: bool = True
    """Also measure the A2F+F2A round trip per layer of every CPU transport
    (`afd_ray.bench.transport`) before the serving runs; CPU only (skipped on `cuda`:
    `python -m afd_ray.bench.cuda_ipc` measures the CUDA one)."""

    device_trace_steps: int = Field(0, ge=0)
    """Record a profiler trace of this many decode steps, after the round's first 16
    (`TRACE_DELAY_STEPS`), of every measured AFD round on both its attention and FFN
    rank, merged onto one clock (`afd_ray.bench.device_trace`, written beside the result
    JSON in `<out stem>-traces/`; the idle split of its summary reads CUDA kernels, so it
    is empty on CPU); `max_tokens` x `requests_per_stream` must exceed 16 + this; traced
    rounds are slower than untraced ones. 0: off."""

    seed: int = 0
    """Weight seed of the tiny checkpoints."""

    checkpoints: Path = Field(default_factory=_default_checkpoints, strict=False)
    """Folder holding the tiny checkpoints (`<family>-seed<seed>/`), built on first use;
    default `<afd_ray cache>/tiny`."""

    slo_ttft_ms: float = Field(2000.0, gt=0)
    """TTFT target of SLO-goodput (`afd_ray.bench.slo`), milliseconds."""

    slo_tpot_ms: float = Field(100.0, gt=0)
    """TPOT target of SLO-goodput (`afd_ray.bench.slo`), milliseconds."""

    price_per_device_hour: float = Field(1.0, gt=0)
    """Price of one device (pool member) for one hour, for the cost per 1M output
    tokens; any currency unit (e.g. an H200's hourly rate)."""

    request_timeout_s: float = Field(300.0, gt=0)
    """HTTP timeout of each request and of each status read, seconds."""

    note: str = (
        "CPU numbers from a small machine shared with other workloads; "
        "compare layouts within one file, not across machines."
    )
    """Free text stored with the results (e.g. how noisy the machine was)."""

    @field_validator("transport")
    @classmethod
    def _transport_carries_the_platform(cls, transport: TransportChoice, info: ValidationInfo) -> TransportChoice:
        # the platform is validated first (fields in order); absent if it failed
        if transport != "auto" and "platform" in info.data:
            check_transport(transport, collective_backend(info.data["platform"]), field=None)
        return transport

    @model_validator(mode="after")
    def _fp8_on_cuda(self) -> BenchConfig:
        if self.quantization is not None and self.platform != "cuda":
            raise ValueError(
                f"quantization: {self.quantization} needs platform cuda (vLLM's FP8 kernels), not {self.platform}"
            )
        return self

    @model_validator(mode="after")
    def _traced_rounds_reach_the_window(self) -> BenchConfig:
        per_stream = self.max_tokens * self.requests_per_stream
        if self.device_trace_steps and per_stream <= TRACE_DELAY_STEPS + self.device_trace_steps:
            raise ValueError(
                f"device_trace_steps: {self.device_trace_steps} steps traced after the first {TRACE_DELAY_STEPS} "
                f"need more than {TRACE_DELAY_STEPS + self.device_trace_steps} tokens per stream and round, not "
                f"max_tokens {self.max_tokens} x requests_per_stream {self.requests_per_stream}; raise either"
            )
        return self

    @model_validator(mode="after")
    def _requests_fit_the_context(self) -> BenchConfig:
        if self.prompt_tokens is not None and self.prompt_tokens + self.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt_tokens: {self.prompt_tokens} + max_tokens {self.max_tokens} > max_model_len "
                f"{self.max_model_len}: the requests do not fit the context; raise max_model_len"
            )
        return self
