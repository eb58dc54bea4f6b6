"""The one typed config tree of afd_ray.

Built once at the entry point (the `args` of `deployments/*.yaml`, or the CLI) and
passed down in sections: the attention pool gets `AttentionPoolConfig`, the FFN pool
`FFNPoolConfig`, the connector `ConnectorConfig`. Every model is frozen after
validation, forbids unknown keys and takes its values strictly (an integer field
takes an integer, never `"2"`, `2.0` or `true`; a float field also takes an integer;
a flag takes only `true`/`false`), so a typo in a YAML file is an error that names
the field.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from afd_ray.connector.link import TransportChoice, check_transport
from afd_ray.platform import collective_backend

__all__ = [
    "AFDConfig",
    "AttentionPoolConfig",
    "AutoscaleConfig",
    "ConnectorConfig",
    "FFNPoolConfig",
    "GatePlacement",
    "IngressConfig",
    "IngressPlacement",
    "ModelConfig",
    "ObservabilityConfig",
    "Platform",
    "PoolPlacement",
]

Platform = Literal["cpu", "cuda", "npu"]
GatePlacement = Literal["gate_on_ffn", "gate_on_attention"]
DType = Literal["float32", "bfloat16", "float16"]
IngressPlacement = Literal["head", "any"]
"""`IngressConfig.placement`."""
CudaGraphMode = Literal["piecewise", "full_decode"]
"""`AttentionPoolConfig.cudagraph_mode` (`afd_ray.attention.engine.afd_compilation_config`)."""
EMBEDDED_MODELS = ("smollm2", "smollm2-moe")


class _Section(BaseModel):
    # strict: no coercion of other types; allow_inf_nan=False: an infinite duration
    # or size is refused here, not when a replica computes with it
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)


class ModelConfig(_Section):
    """Which checkpoint to serve, shared by both roles."""

    source: str = "smollm2"
    """An embedded model name (`smollm2`, or its Mixtral upcycling `smollm2-moe`) or a
    path to a Hugging Face checkpoint folder (config.json + safetensors + tokenizer)."""

    served_name: str | None = None
    """The model id clients put in `"model"`; defaults to `source`."""

    dtype: DType = "float32"
    """Parameter and activation dtype on both roles."""

    max_model_len: int = Field(2048, ge=16)
    """Context length in tokens (prompt + completion)."""

    load_format: Literal["auto", "dummy"] = "auto"
    """`auto`: both roles read their weights from the checkpoint's safetensors.
    `dummy`: neither reads any; every weight is random (vLLM's `load_format="dummy"`
    on the attention role, the same values on the FFN role: `afd_ray.ffn.model.dummy_fill`),
    so a folder with a `config.json` and a tokenizer is enough: for benchmarks of model
    shapes whose weights are not at hand. Outputs are then meaningless text, the same as
    plain vLLM's with `load_format="dummy"`."""

    @model_validator(mode="after")
    def _source_exists(self) -> ModelConfig:
        if self.source not in EMBEDDED_MODELS and not (Path(self.source) / "config.json").is_file():
            raise ValueError(
                f"model.source: {self.source!r} is neither an embedded model "
                f"{EMBEDDED_MODELS} nor a folder with a config.json"
            )
        return self

    @property
    def name(self) -> str:
        """The id that `/v1/models` lists and requests must use."""
        return self.served_name or self.source


_RESERVED_RESOURCES = frozenset({"CPU", "GPU", "NPU", "memory", "object_store_memory"})


class PoolPlacement(_Section):
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


class AttentionPoolConfig(_Section):
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


EP_IDLE_CHECK_MAX_US = 1_000_000
"""Upper bound of `FFNPoolConfig.ep_idle_check_us` and `ep_idle_max_check_us`,
microseconds (1 s). Both are waits on the decode path: a busy EP rank waits up to
`ep_idle_check_us` for its idle peers at every step, and the first step after an
idle spell up to `ep_idle_max_check_us`, so each adds to the output tokens' latency;
a stopping FFN rank also finishes its current wait first. A check-in interval that
long is a unit typo (seconds or milliseconds given as microseconds)."""


class FFNPoolConfig(_Section):
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

    @model_validator(mode="after")
    def _idle_bounds(self) -> FFNPoolConfig:
        if self.ep_idle_max_check_us < self.ep_idle_check_us:
            raise ValueError(
                f"ffn.ep_idle_max_check_us: {self.ep_idle_max_check_us} < ffn.ep_idle_check_us {self.ep_idle_check_us}"
            )
        return self


BATCH_WINDOW_MAX_US = 100_000
"""Upper bound of `ConnectorConfig.batch_window_us`, microseconds (100 ms). While one
attention peer of an FFN rank is idle (no step to announce), every step of the others
waits the whole window, so it adds to each of their output tokens' latency; a peer
that misses the window joins the next step, so a window much longer than a decode
step only adds latency."""


class ConnectorConfig(_Section):
    """The A2F/F2A transport between attention and FFN ranks."""

    timeout_s: float = Field(120.0, gt=0)
    """Bound on pair rendezvous and on every A2F/F2A receive, seconds; past it the
    receive fails with the process group's error instead of hanging."""

    batch_window_us: int = Field(500, ge=0, le=BATCH_WINDOW_MAX_US)
    """Once one attention peer's step header reached an FFN rank, how long it waits for
    the other peers' headers before it starts the step without them, microseconds.
    Bounds how long a slow or idle attention rank can delay the others. At most
    `BATCH_WINDOW_MAX_US` (100 ms)."""

    host: str | None = None
    """Address FFN ranks bind their header socket and rendezvous store to; None (the
    default) means the IP of the Ray node each FFN rank runs on, which works whether
    the pools share a node or span several; `127.0.0.1` keeps a one-node deployment
    off the network."""

    peer_lost_wait_s: float = Field(120.0, gt=0)
    """How long an attention rank whose FFN peer died inside a forward pass waits for
    its new peer (then repeats the current layer's exchange there), seconds; past it
    the pass fails and the rank's requests end with an explicit error."""

    transport: TransportChoice = "auto"
    """Data plane of each attention↔FFN pair (`afd_ray.connector.link`). `auto`:
    on one Ray node `shm` (CPU) or `cuda_ipc` (CUDA), across nodes `gloo` (CPU) or
    `nccl` (CUDA); `hccl` on Ascend. A fixed value must carry the platform's tensors
    (`shm`/`gloo` on CPU, `nccl`/`cuda_ipc` on CUDA)."""


class IngressConfig(_Section):
    """The OpenAI HTTP front (a Serve deployment that only forwards requests)."""

    max_ongoing_requests: int = Field(256, ge=1)
    """HTTP requests one ingress replica holds at once, open streams included;
    beyond it Serve's proxy queues them. Must exceed the admission capacity
    (`attention.max_ranks` x (`attention.max_num_seqs` + `max_queued_per_rank`)), so
    that requests over it reach the ingress and are refused instead of queued."""

    max_queued_per_rank: int = Field(16, ge=0)
    """Admission: requests per READY attention rank that may wait for an engine slot
    beyond `attention.max_num_seqs`; a request past `ranks x (max_num_seqs +
    max_queued_per_rank)` in flight is refused (429)."""

    max_kv_cache_usage: float = Field(0.95, gt=0, le=1)
    """Admission: no new request while the attention ranks' KV-cache usage (mean of
    their latest reports, vLLM `kv_cache_usage`) is at or above this fraction."""

    max_ffn_tokens_per_step: int | None = Field(None, ge=1)
    """Admission: no new request while the FFN ranks' token rows per step (over the
    coordinator's signal window) are at or above this; None: no bound."""

    retry_after_s: int = Field(1, ge=1)
    """`Retry-After` of a refused request (429/503), seconds."""

    body_timeout_s: float = Field(30.0, gt=0)
    """An admitted inference request's body must arrive whole within this, seconds;
    else it is answered 408 and its admission place is given back (admission is
    decided on the headers, so a client that stalls its upload would otherwise hold
    a place for as long as it keeps the connection open)."""

    api_key_env: str | None = None
    """Name of the environment variable that holds the API key of the OpenAI routes
    (`Authorization: Bearer <key>`); None: the routes are open. The key itself never
    goes in the YAML."""

    admin_key_env: str | None = None
    """Name of the environment variable that holds the admin key of `POST /afd/scale`
    and `/afd/autoscale/*`; None: those routes are open."""

    placement: IngressPlacement = "head"
    """Ray node of the ingress replicas. HAProxy passes each request to an ingress
    replica's own HTTP server, which listens on `http_options.host` of the node it runs
    on (docs/ingress.md). `head` (default): Ray's head node, where the
    Serve controller and the HAProxy that clients reach run, so with `host: 127.0.0.1`
    (the shipped YAMLs) HAProxy reaches the replica; placed on another node it could
    not, and HAProxy would pass every request through its backup Serve proxy, the slow
    path. `any`: whichever node Ray picks, for clusters whose `http_options.host` is
    `0.0.0.0` (or another address every node's HAProxy reaches)."""


class AutoscaleConfig(_Section):
    """Resizing A:F while serving: manual `POST /afd/scale` and the autoscaler."""

    enabled: bool = False
    """Let the autoscaling policy change the pool sizes (a manual resize pauses it
    until `POST /afd/autoscale/resume`)."""

    policy: str | None = Field(None, min_length=1)
    """Path of the autoscaling policy YAML (`afd_ray.autoscale.policy.AutoscalePolicy`,
    e.g. `deployments/autoscale.yaml`); needed when `enabled`."""

    interval_s: float = Field(5.0, gt=0)
    """How often the autoscaler evaluates the policy, seconds."""

    drain_timeout_s: float = Field(30.0, gt=0)
    """How long a removed attention rank keeps serving the requests it already has,
    seconds; requests still running then end with an explicit error."""

    resize_timeout_s: float = Field(600.0, gt=0)
    """Bound on one resize (replicas started, weights loaded, layout switched),
    seconds; past it `POST /afd/scale` answers 504 and the resize event says why."""


class ObservabilityConfig(_Section):
    """Metrics and per-step timing records (`afd_ray.observability`)."""

    metrics: bool = True
    """Export the `afd_*` metrics and vLLM's engine metrics through `ray.util.metrics`
    (Ray dashboard, Prometheus)."""

    step_records: int = Field(4096, ge=0)
    """Step timing records each rank keeps in a ring buffer, for per-token breakdowns
    (`afd-ray trace`); 0 keeps none."""


class AFDConfig(_Section):
    """Root of the config tree: the `args` of `deployments/afd.yaml`."""

    platform: Platform = "cpu"
    """Device family of both pools; fixes the torch device, the collective backend
    (gloo/nccl/hccl) and the Ray resource key (CPU/GPU/NPU)."""

    gate_placement: GatePlacement = "gate_on_ffn"
    """Where MoE routing runs (docs/models.md, gate placement). `gate_on_ffn`: the FFN receives hidden
    states and routes them. `gate_on_attention`: the attention rank computes the
    top-k ids and weights and sends them with the hidden states, and dense MLP layers
    stay on the attention rank (MoE models only)."""

    model: ModelConfig = ModelConfig()
    ingress: IngressConfig = IngressConfig()
    attention: AttentionPoolConfig = AttentionPoolConfig()
    ffn: FFNPoolConfig = FFNPoolConfig()
    connector: ConnectorConfig = ConnectorConfig()
    autoscale: AutoscaleConfig = AutoscaleConfig()
    observability: ObservabilityConfig = ObservabilityConfig()

    @model_validator(mode="after")
    def _bounds(self) -> AFDConfig:
        for name, pool in (("attention", self.attention), ("ffn", self.ffn)):
            if not pool.min_ranks <= pool.num_ranks:
                raise ValueError(f"{name}.min_ranks: {pool.min_ranks} > {name}.num_ranks {pool.num_ranks}")
            if pool.upper < pool.num_ranks:
                raise ValueError(f"{name}.max_ranks: {pool.max_ranks} < {name}.num_ranks {pool.num_ranks}")
        peers = math.ceil(self.attention.upper / self.ffn.min_ranks)  # most attention peers of one FFN rank
        if self.ffn.ubatches > peers:
            raise ValueError(
                f"ffn.ubatches: {self.ffn.ubatches} > {peers}, the most attention peers one FFN rank can have "
                f"(attention.max_ranks {self.attention.upper} / ffn.min_ranks {self.ffn.min_ranks}, rounded up); "
                "a step's peers are split into at most that many ubatches"
            )
        if self.ffn.ep_idle_max_check_us / 1e6 >= self.connector.timeout_s:
            raise ValueError(
                f"ffn.ep_idle_max_check_us: {self.ffn.ep_idle_max_check_us} us must be shorter than "
                f"connector.timeout_s {self.connector.timeout_s} s, the EP group's collective timeout: a busy rank "
                "waits that long for an idle one to check in"
            )
        if self.connector.transport != "auto":
            check_transport(self.connector.transport, collective_backend(self.platform))
        capacity = self.attention.upper * (self.attention.max_num_seqs + self.ingress.max_queued_per_rank)
        if self.ingress.max_ongoing_requests <= capacity:
            raise ValueError(
                f"ingress.max_ongoing_requests: {self.ingress.max_ongoing_requests} must exceed the admission "
                f"capacity {capacity} (attention.max_ranks x (attention.max_num_seqs + ingress.max_queued_per_rank))"
            )
        if self.autoscale.enabled and self.autoscale.policy is None:
            raise ValueError("autoscale.policy: a policy file is needed when autoscale.enabled is true")
        return self
