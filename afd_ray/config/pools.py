"""`attention` and `ffn`: the two pools, their sizes, engines and placement."""

from __future__ import annotations

from pydantic import Field, JsonValue, ValidatorFunctionWrapHandler, field_validator, model_validator

from afd_ray.config.base import CudaGraphMode, Section
from afd_ray.config.eplb import EPLBConfig
from afd_ray.config.engine_args import EngineArgName, validate_engine_args

__all__ = ["EP_IDLE_CHECK_MAX_US", "AttentionPoolConfig", "FFNPoolConfig", "PoolPlacement"]

_RESERVED_RESOURCES = frozenset({"CPU", "GPU", "NPU", "memory", "object_store_memory"})


class PoolPlacement(Section):
    """Which Ray nodes a pool's members may run on; carried into each member's
    placement-group bundle, so Ray places (and re-places) them there."""

    resources: dict[str, float] = {}
    """Custom Ray resources each member's bundle claims besides its CPU/GPU/NPU
    share, e.g. `{"ffn_node": 1}` with the FFN nodes started as
    `ray start --resources '{"ffn_node": 8}'`."""

    node_labels: dict[str, str] = {}
    """Ray node labels a member's node must carry (`ray start --labels`), e.g.
    `{"afd-pool": "ffn"}`; Ray's bundle label selector."""

    @field_validator("resources")
    @classmethod
    def _custom_only(cls, resources: dict[str, float]) -> dict[str, float]:
        for name, amount in resources.items():
            if name in _RESERVED_RESOURCES:
                raise ValueError(f"{name!r} is set by bundle_resources and the platform, not here")
            if not amount > 0:
                raise ValueError(f"{name!r}: amount must be > 0, got {amount}")
        return resources


class AttentionPoolConfig(Section):
    """The attention pool: vLLM engines that own requests and the KV cache."""

    num_ranks: int = Field(1, ge=1)
    """Attention ranks (Serve replicas of `AttentionServer`) at start."""

    min_ranks: int = Field(1, ge=1)
    """Fewest attention ranks a resize (manual or autoscaled) may leave."""

    max_ranks: int | None = Field(None, ge=1)
    """Most attention ranks a resize may start; None means `num_ranks`."""

    @property
    def upper(self) -> int:
        """`max_ranks`, or `num_ranks` when unset."""
        return self.num_ranks if self.max_ranks is None else self.max_ranks

    bundle_resources: float = Field(1.0, gt=0)
    """Amount of the platform resource key (CPU/GPU/NPU) in each member's bundle."""

    kv_cache_gib: float = Field(1.0, gt=0)
    """KV-cache space per rank in GiB (vLLM `kv_cache_memory_bytes`; on CPU a
    `VLLM_CPU_KVCACHE_SPACE` in the environment overrides it)."""

    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """GPU only: fraction of the GPU's memory that must be free when the attention
    engine starts (vLLM's `gpu_memory_utilization`, checked at start-up; the KV cache
    itself is sized by `kv_cache_gib`). When the FFN role shares the GPU (fractional
    bundles), keep it below 1 minus the FFN's share (its weights and graph buffers)."""

    max_num_seqs: int = Field(16, ge=1)
    """Largest number of requests one engine step may batch."""

    stream_interval: int = Field(1, ge=1)
    """Output tokens per streamed chunk (vLLM's `stream_interval`): a streaming request
    gets a chunk every this many tokens, and at its first and last token. 1 sends
    every token as it is sampled. Larger values cut the per-chunk host work of the
    engine's output path and of each Serve hop (attention replica, ingress, proxy)
    by that factor, at the cost of smoothness: each chunk relayed costs the same
    however many tokens it holds, so at high batch a per-token stream is bound by
    chunks per second, not by the model (on one H200 the product benchmark's output
    tok/s stayed at about 1600-2300 from batch 16 to 256 with 1, plain vLLM too)."""

    enforce_eager: bool = True
    """Skip torch.compile / CUDA graphs in the attention engine (fast start)."""

    cudagraph_mode: CudaGraphMode = "full_decode"
    """CUDA only, without `enforce_eager`: how vLLM's CUDA graphs hold the FFN exchange.
    `full_decode` (default): decode batches replay one graph of the whole forward
    pass, exchange included (device-side signals only), and the STEP header is sent on
    the host before each replay; prefill and mixed batches run piecewise. `piecewise`:
    graphs split at the FFN boundary ops, whose exchange runs eagerly between captured
    pieces. `afd_ray.attention.engine.afd_compilation_config` gives the details,
    including failure semantics; docs/cuda.md compares the two modes."""

    num_threads: int = Field(1, ge=1)
    """Torch/OpenMP threads of the engine worker process."""

    placement: PoolPlacement = PoolPlacement()
    """Ray nodes the attention ranks may run on (default: any)."""

    engine_args: dict[EngineArgName, JsonValue] = {}
    """Further vLLM engine arguments of the attention engine (and of the benchmark's
    plain engine), as Ray Serve LLM's `engine_kwargs`: e.g. `{enable_prefix_caching:
    true, max_num_batched_tokens: 512, seed: 7}`. Each key must be a field of the
    installed vLLM's `EngineArgs` that afd_ray does not set itself
    (`afd_ray.config.engine_args.OWNED`: those name the afd_ray key to use), and each
    value must fit that field's type. docs/configuration.md has the table."""

    @field_validator("engine_args", mode="wrap")
    @classmethod
    def _engine_arg_values(cls, args: object, handler: ValidatorFunctionWrapHandler) -> dict[str, JsonValue]:
        return validate_engine_args(args, handler, where="attention.engine_args")


EP_IDLE_CHECK_MAX_US = 1_000_000
"""Upper bound of `FFNPoolConfig.ep_idle_check_us` and `ep_idle_max_check_us`,
microseconds (1 s). Both are waits on the decode path: a busy EP rank waits up to
`ep_idle_check_us` for its idle peers at every step, and the first step after an
idle spell up to `ep_idle_max_check_us`, so each adds to the output tokens' latency;
a stopping FFN rank also finishes its current wait first. A check-in interval that
long is a unit typo (seconds or milliseconds given as microseconds)."""


class FFNPoolConfig(Section):
    """The FFN pool: stateless expert/MLP workers, no KV cache, no user requests."""

    num_ranks: int = Field(1, ge=1)
    """FFN ranks (Serve replicas of `FFNServer`) at start."""

    min_ranks: int = Field(1, ge=1)
    """Fewest FFN ranks a resize (manual or autoscaled) may leave."""

    max_ranks: int | None = Field(None, ge=1)
    """Most FFN ranks a resize may start; None means `num_ranks`."""

    @property
    def upper(self) -> int:
        """`max_ranks`, or `num_ranks` when unset."""
        return self.num_ranks if self.max_ranks is None else self.max_ranks

    bundle_resources: float = Field(1.0, gt=0)
    """Amount of the platform resource key (CPU/GPU/NPU) in each member's bundle."""

    num_threads: int = Field(1, ge=1)
    """Torch intra-op threads of the FFN worker."""

    placement: PoolPlacement = PoolPlacement()
    """Ray nodes the FFN ranks may run on (default: any)."""

    ubatches: int = Field(1, ge=1, le=8)
    """DBO across attention ranks: each FFN rank serves a step's attention peers in up
    to this many ubatches per layer, one after the other, so that one ubatch's
    attention (on its own attention ranks) runs while the FFN computes another's: the
    ping-pong of MegaScale-Infer (arXiv 2504.02263, §4). Takes effect with at least
    two attention ranks per FFN rank and without EP (with EP a step runs as one
    ubatch). 1: every peer's rows are computed at once (one weight read per layer).
    At most the attention peers one FFN rank can have, ceil(`attention.max_ranks` /
    `ffn.min_ranks`): a step never has more ubatches than peers, so more is refused."""

    heartbeat_timeout_s: float = Field(30.0, gt=0)
    """An FFN rank that sent no report (every 0.2 s) for this long is dead: the
    coordinator removes it from the layout (a killed replica is found sooner, from
    Serve's replica states), seconds. 10 s declared a live, loading rank dead on a
    2-core machine at load average 11."""

    standby_ranks: int = Field(0, ge=0)
    """FFN ranks kept started, loaded and registered with the coordinator but outside
    the layout (`MemberState.STANDBY`): the FFN deployment runs the FFN target plus
    this many replicas. On an FFN rank's loss the coordinator takes a standby into the
    layout under a new epoch at once instead of waiting for Serve's replacement
    replica (a new process: Python start, torch and vLLM import, weight load), which
    then stands by in its place. A standby holds every routed expert (the whole FFN
    stack), so it takes any EP rank without reading the checkpoint; it costs one full
    FFN stack of memory each (docs/failures.md). Not counted in the FFN target, in
    pool sizes or as serving capacity. 0 (default): no standby."""

    ep_idle_check_us: int = Field(2000, ge=100, le=EP_IDLE_CHECK_MAX_US)
    """With several FFN ranks (EP), how often an idle rank checks in with its EP
    group while the group is busy, microseconds; bounds how long a busy rank waits
    for the idle ones. At most `EP_IDLE_CHECK_MAX_US` (1 s)."""

    ep_idle_max_check_us: int = Field(20000, ge=100, le=EP_IDLE_CHECK_MAX_US)
    """While the whole EP group is idle, the check-in interval doubles from
    `ep_idle_check_us` up to this, microseconds: the first step after an idle spell
    waits at most this long for the other ranks, and an idle group costs ~10x fewer
    all-reduces (at 2 ms, two idle CPU ranks spun through 500 a second). At most
    `EP_IDLE_CHECK_MAX_US` (1 s), and shorter than `connector.timeout_s`, the
    timeout of the EP group's collectives, which a busy rank's count all-reduce
    would otherwise pass while an idle rank sleeps."""

    eplb: EPLBConfig = EPLBConfig()
    """Expert load balancing across the EP ranks (docs/eplb.md)."""

    @model_validator(mode="after")
    def _eplb_pool(self) -> FFNPoolConfig:
        if self.eplb.num_redundant_experts and self.min_ranks < 2:
            raise ValueError(
                f"ffn.eplb.num_redundant_experts: {self.eplb.num_redundant_experts} needs ffn.min_ranks >= 2 "
                f"(a replica must sit on another EP rank), got {self.min_ranks}"
            )
        return self

    @model_validator(mode="after")
    def _idle_bounds(self) -> FFNPoolConfig:
        if self.ep_idle_max_check_us < self.ep_idle_check_us:
            raise ValueError(
                f"ffn.ep_idle_max_check_us: {self.ep_idle_max_check_us} < ffn.ep_idle_check_us {self.ep_idle_check_us}"
            )
        return self
