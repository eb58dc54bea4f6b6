"""`connector`, `ingress`, `autoscale` and `observability`: how the pools are joined,
reached, resized and watched."""

from __future__ import annotations

from pydantic import Field

from afd_ray.config.base import IngressPlacement, Section
from afd_ray.connector.transports import TransportChoice

__all__ = [
    "BATCH_WINDOW_MAX_US",
    "AutoscaleConfig",
    "ConnectorConfig",
    "IngressConfig",
    "ObservabilityConfig",
]

BATCH_WINDOW_MAX_US = 100_000
"""Upper bound of `ConnectorConfig.batch_window_us`, microseconds (100 ms). While one
attention peer of an FFN rank is idle (no step to announce), every step of the others
waits the whole window, so it adds to each of their output tokens' latency; a peer
that misses the window joins the next step, so a window much longer than a decode
step only adds latency."""


class ConnectorConfig(Section):
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


class IngressConfig(Section):
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
    """Name of the environment variable that holds the admin key of `POST /afd/scale`,
    `POST /afd/eplb` and `/afd/autoscale/*`; None: those routes are open."""

    placement: IngressPlacement = "head"
    """Ray node of the ingress replicas. HAProxy passes each request to an ingress
    replica's own HTTP server, which listens on `http_options.host` of the node it runs
    on (docs/ingress.md). `head` (default): Ray's head node, where the
    Serve controller and the HAProxy that clients reach run, so with `host: 127.0.0.1`
    (the shipped YAMLs) HAProxy reaches the replica; placed on another node it could
    not, and HAProxy would pass every request through its backup Serve proxy, the slow
    path. `any`: whichever node Ray picks, for clusters whose `http_options.host` is
    `0.0.0.0` (or another address every node's HAProxy reaches)."""


class AutoscaleConfig(Section):
    """Resizing A:F while serving: manual `POST /afd/scale` and the autoscaler."""

    enabled: bool = False
    """Let the autoscaling policy change the pool sizes (a manual resize pauses it
    until `POST /afd/autoscale/resume`)."""

    policy: str | None = Field(None, min_length=1)
    """Path of the autoscaling policy YAML (`afd_ray.autoscale.schema.AutoscalePolicy`,
    e.g. `deployments/autoscale.yaml`); needed when `enabled`."""

    interval_s: float = Field(5.0, gt=0)
    """How often the autoscaler evaluates the policy, seconds."""

    drain_timeout_s: float = Field(30.0, gt=0)
    """How long a removed attention rank keeps serving the requests it already has,
    seconds; requests still running then end with an explicit error."""

    resize_timeout_s: float = Field(600.0, gt=0)
    """Bound on one resize (replicas started, weights loaded, layout switched),
    seconds; past it `POST /afd/scale` answers 504 and the resize event says why."""


class ObservabilityConfig(Section):
    """Metrics and per-step timing records (`afd_ray.observability`)."""

    metrics: bool = True
    """Export the `afd_*` metrics and vLLM's engine metrics through `ray.util.metrics`
    (Ray dashboard, Prometheus)."""

    step_records: int = Field(4096, ge=0)
    """Step timing records each rank keeps in a ring buffer, for per-token breakdowns
    (`afd-ray trace`); 0 keeps none."""
