"""Membership records exchanged through the coordinator (JSON-serializable).

Every pool member goes through `MemberState` STARTING -> READY -> DRAINING -> GONE,
changed only by `MemberState.to` (a member may also fail straight to GONE).
"""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict

from afd_ray.autoscale.schema import MetricsSnapshot
from afd_ray.connector.header import FFNAddress
from afd_ray.connector.transports import Transport
from afd_ray.eplb.records import EPLBStatus
from afd_ray.observability.timeline import StepSplit
from afd_ray.platform import Backend

__all__ = [
    "AFDStatus",
    "AdmissionState",
    "AttentionAssignment",
    "AttentionDirective",
    "AttentionMember",
    "EPAssignment",
    "FFNDirective",
    "FFNMember",
    "LayoutPlan",
    "LoopState",
    "MemberState",
    "PoolLoad",
    "RecoveryEvent",
    "ResizeEvent",
    "ScaleRequest",
]


class MemberState(str, Enum):
    """Lifecycle of one pool member (an attention or FFN rank)."""

    STARTING = "starting"
    """Registered; loading weights, opening channels; serves nothing yet."""
    STANDBY = "standby"
    """FFN only (`ffn.standby_ranks`): registered outside the layout, loading or holding
    every expert and listening; serves nothing until a recovery or a scale-out takes
    it into the layout (then READY). Not counted in pool sizes or capacity."""
    READY = "ready"
    """Serving: an attention rank takes requests, an FFN rank is in the layout."""
    DRAINING = "draining"
    """Being removed: an attention rank finishes its requests (up to the drain
    timeout) and takes no new ones; an FFN rank hands its experts and peers over."""
    GONE = "gone"
    """Detached: holds no peer, no pair channel, no EP group."""

    def to(self, new: MemberState) -> MemberState:
        """`new`, if the lifecycle allows going there from this state.

        Raises:
            ValueError: a backward move (e.g. DRAINING -> READY) or leaving GONE.
        """
        order = list(MemberState)
        if order.index(new) < order.index(self) or self is MemberState.GONE:
            raise ValueError(f"member state: {self.value} -> {new.value} is not allowed")
        return new


class LoopState(str, Enum):
    """What an FFN rank's loop does, as the rank reports it (every 0.2 s)."""

    SERVING = "serving"
    """It serves the steps of the layout of its epoch."""
    EP_LOST = "ep_lost"
    """Its EP group failed (another EP rank of its layout died): it serves nothing,
    its attention pairs are closed, and it waits for the re-formed layout."""
    STOPPED = "stopped"
    """The loop ended (it failed, or the coordinator fenced the rank)."""


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class AttentionAssignment(_Record):
    """What an attention rank needs to open its pair channel to its FFN peer."""

    peer: int
    """This attention rank's id."""
    ffn_rank: int
    host: str
    store_port: int
    control_port: int
    epoch: int
    transport: Transport
    """Data plane of the pair (`afd_ray.connector.transports.select_transport`)."""
    timeout_s: float
    """Bound on rendezvous and on every receive, seconds."""
    rescue: str = ""
    """ZeroMQ endpoint of the rank's `AttentionServer` that hands the worker its new FFN
    peer when the peer dies inside a forward pass ("": none; the server fills it in)."""
    peer_lost_wait_s: float = 0.0
    """How long the worker waits there for a new peer, seconds (`connector.peer_lost_wait_s`)."""

    @property
    def address(self) -> FFNAddress:
        return FFNAddress(self.host, self.store_port, self.control_port)

    @classmethod
    def to_ffn(
        cls, address: FFNAddress, peer: int, ffn_rank: int, epoch: int, transport: Transport, timeout_s: float
    ) -> AttentionAssignment:
        """Attention rank `peer`'s pairing with FFN rank `ffn_rank`, reached at `address`,
        under `epoch` (no rescue endpoint: the `AttentionServer` fills it in)."""
        return cls(
            peer=peer,
            ffn_rank=ffn_rank,
            host=address.host,
            store_port=address.store_port,
            control_port=address.control_port,
            epoch=epoch,
            transport=transport,
            timeout_s=timeout_s,
        )


class EPAssignment(_Record):
    """An FFN rank's place in the FFN layout of `epoch`: its EP rank among the FFN
    ranks of that layout; the store of the layout's first FFN rank hosts the EP
    group's rendezvous (under the prefix `afd/ep/<epoch>`)."""

    ep_rank: int
    ep_size: int
    host: str
    store_port: int
    epoch: int
    backend: Backend
    timeout_s: float
    ranks: tuple[int, ...] = ()
    """The FFN ranks of that layout in EP order (what the rank tells a restarted
    coordinator, `Registry.rejoin_ffn`)."""
    placements: tuple[tuple[tuple[int, ...], ...], ...] | None = None
    """EPLB: `[MoE layer][EP rank]` the logical expert of each slot of this layout
    (`afd_ray.control.eplb`); None: contiguous blocks."""
    standby: bool = False
    """The rank stands by outside the layout (`MemberState.STANDBY`): it loads every
    expert (EP rank 0 of 1, `ranks` empty) and serves no layout until a plan takes it
    in; `epoch` is then the layout epoch it started standing by under."""


class LayoutPlan(_Record):
    """The FFN layout of `epoch` that an FFN rank must prepare (make before break):
    load the experts `assignment` gives it and open that epoch's EP group while the
    old layout serves; every FFN rank then switches at one agreed step boundary."""

    epoch: int
    assignment: EPAssignment | None
    """This rank's place in the new layout; None: it leaves the layout at the switch."""


class FFNDirective(_Record):
    """The coordinator's answer to an FFN rank's report."""

    plan: LayoutPlan | None = None
    """The layout to prepare while a resize is pending."""
    dead_peers: list[int] = []
    """Attention ranks peered with this FFN rank whose replica vanished without a
    LEAVE (it died or was killed): drop their pairs at a step boundary."""
    rejoin: bool = False
    """The coordinator does not know this rank (it restarted): re-register
    (`Coordinator.rejoin_ffn`)."""
    fenced: bool = False
    """The coordinator removed this rank (found dead, or scaled in); it must never
    serve again: stop the loop (closing every pair) and fail Serve's health check, so
    that Serve replaces the replica."""


class AttentionDirective(_Record):
    """What the coordinator wants of one attention rank now (it polls for it)."""

    state: MemberState
    assignment: AttentionAssignment | None
    """Its current FFN peer; when its epoch is newer than the pairing the rank holds,
    the rank re-peers between two engine steps. None: the coordinator (restarted)
    does not know that FFN peer yet; the rank keeps the pairing it holds."""


class ScaleRequest(_Record):
    """Body of `POST /afd/scale`: the pool sizes to reach. Strict: JSON integers only
    (`"2"`, `2.0` or `true` are errors naming the field, never converted)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    attention: int
    """Attention ranks, within `attention.min_ranks`..`attention.max_ranks`."""
    ffn: int
    """FFN ranks, within `ffn.min_ranks`..`ffn.max_ranks`."""


class FFNMember(_Record):
    """One FFN rank as `/afd/status` shows it."""

    rank: int
    address: FFNAddress
    replica: str = ""
    """Serve replica id of the `FFNServer` that holds this rank."""
    state: MemberState = MemberState.STARTING
    epoch: int | None = None
    """Layout epoch this rank serves now (None: it has not reported serving one yet)."""
    ep_rank: int | None = None
    """Its EP rank in the serving layout as that layout was formed: the shard of
    experts it holds (None: in no serving layout, e.g. a rank joining it, or GONE).
    While a new layout is prepared, or a lost one re-formed, it stays the rank's place
    in the old layout until the new one serves (`Registry.switch_layout`)."""
    loop: LoopState | None = None
    """What its FFN loop did at its latest report (None: no report yet)."""
    steps: int = 0
    layers: int = 0
    tokens: int = 0
    busy_s: float = 0.0
    a2f_bytes: int = 0
    f2a_bytes: int = 0
    split: StepSplit = StepSplit()
    """The step split of its timed steps (`FFNStats.split`)."""
    compute_s: float = 0.0
    """FFN compute, EP collectives excluded, summed over steps, seconds (`FFNStats.compute_s`)."""
    ep_s: float = 0.0
    """EP collectives, summed over steps, seconds (`FFNStats.ep_s`): waits for the straggler."""
    expert_tokens: list[int] = []
    """Rows this rank's tokens routed to each expert, summed over MoE layers and steps;
    divided by `steps` x MoE layers it is tokens per expert per step (expert load)."""

    def reached(self, epoch: int) -> bool:
        """It serves the layout of `epoch` or a newer one (False before it served any)."""
        return self.epoch is not None and self.epoch >= epoch


class AttentionMember(_Record):
    """One attention rank as `/afd/status` shows it."""

    rank: int
    ffn_peer: int
    state: MemberState = MemberState.STARTING
    epoch: int = 0
    """Epoch of its current pairing with `ffn_peer`."""
    replica: str = ""
    """Serve replica id of the `AttentionServer` that holds this rank."""
    node: str = ""
    """Ray node id of its replica (picks the pair's transport with `auto`)."""
    peered_epoch: int | None = None
    """Epoch of the pairing the rank reported open (`epoch` once it moved; None: it
    has reported no pairing open yet)."""

    @property
    def peered(self) -> bool:
        """It reported the pairing of its current `epoch` (or a newer one) open."""
        return self.peered_epoch is not None and self.peered_epoch >= self.epoch


class ResizeEvent(_Record):
    """One change of the pool sizes, as `/afd/status` and the log show it."""

    reason: str
    """Why: `manual` (POST /afd/scale) or the autoscaling policy's reason."""
    from_attention: int
    from_ffn: int
    to_attention: int
    to_ffn: int
    epoch: int
    """Layout epoch once the new layout serves."""
    started_s: float
    """Unix time the resize began, seconds."""
    duration_s: float = 0.0
    """Until the new layout served, seconds."""
    pause_s: float = 0.0
    """Longest time the FFN pool did not step during the resize while requests were
    running (the longest gap between FFN steps), seconds."""
    bytes_loaded: int = 0
    """Weight bytes FFN ranks loaded for the new layout (new ranks' shards and old
    ranks' new experts)."""
    error: str | None = None
    """Why the resize did not complete, if it did not."""


class PoolLoad(_Record):
    """What the ingress admits requests against (`Coordinator.pool_load`), refreshed
    every `_LOAD_PERIOD_S` of the ingress."""

    attention_ranks: int
    """READY attention ranks (they take requests)."""
    kv_cache_usage: float = 0.0
    """Mean KV-cache usage of the attention ranks' latest reports, fraction."""
    ffn_tokens_per_step: float = 0.0
    """Token rows per FFN step over the signal window (`MetricsSnapshot.tokens_per_ffn_step`)."""
    ttft_p90_s: float = 0.0
    """p90 time to first token over the signal window, seconds (0: no sample)."""
    tpot_p90_s: float = 0.0
    """p90 time per output token over the signal window, seconds (0: no sample)."""
    resizing: bool = False
    """A resize is running: refusals are 503 (the capacity is changing), not 429."""
    recovering: bool = False
    """Lost FFN ranks are being replaced: refusals are 503, not 429."""


class RecoveryEvent(_Record):
    """The loss of FFN ranks and the layout's recovery, as `/afd/status` shows it."""

    lost: list[int]
    """FFN ranks found dead (their replica vanished, their FFN loop stopped, or no
    report within `ffn.heartbeat_timeout_s`)."""
    cause: str
    """How the first of them was found dead."""
    detected_s: float
    """Unix time the coordinator found them dead, seconds."""
    since_report_s: float
    """Time from the lost rank's last report to its detection, seconds (the detection
    delay, within one report period of it)."""
    epoch: int = 0
    """Layout epoch of the recovered layout."""
    whole_s: float | None = None
    """From detection until the layout again had its target number of FFN ranks
    serving, seconds (None: not whole yet)."""
    bytes_loaded: int = 0
    """Weight bytes the ranks of the recovered layout loaded from the checkpoint."""
    attempts: int = 0
    """Attempts to re-form the layout so far (a failed one is retried, `afd_ray.control.recovery`)."""
    error: str | None = None
    """Why the latest attempt failed (None once the layout recovered)."""


class AdmissionState(_Record):
    """The ingress's admission state, as `/afd/status` shows it."""

    in_flight: int
    """Requests the ingress admitted that have not finished."""
    capacity: int
    """READY attention ranks x (`attention.max_num_seqs` + `ingress.max_queued_per_rank`)."""
    admitted: int = 0
    refused_429: int = 0
    """Refused for load (queue room, KV headroom, FFN tokens, an infeasible deadline)."""
    refused_503: int = 0
    """Refused while the pools were resizing or had no READY attention rank."""
    expired: int = 0
    """Admitted requests ended by their `x-request-deadline-ms`."""
    resumed: int = 0
    """Streams moved to another attention rank because theirs died (`afd_ray.serve.resume`)."""
    last_refusal: str | None = None
    """Why the latest request was refused."""
    load: PoolLoad | None = None
    """The pools' load the ingress admits against (None: not read yet)."""
    load_age_s: float = 0.0
    """Seconds since `load` was read from the coordinator."""


class AFDStatus(_Record):
    """Body of `GET /afd/status`."""

    epoch: int
    attention: list[AttentionMember]
    ffn: list[FFNMember]
    attention_waiting: dict[str, float] = {}
    """Attention replicas that wait for the FFN layout before they get a rank (e.g.
    while the FFN ranks start), by Serve replica id: seconds waited so far (at most
    `autoscale.resize_timeout_s`)."""
    target_attention: int = 0
    target_ffn: int = 0
    target_standby: int = 0
    """FFN standby ranks kept outside the layout (`ffn.standby_ranks`); the `ffn`
    members in state `standby` are those standing by now."""
    autoscale_paused: bool = False
    """A manual resize paused the autoscaler (until `POST /afd/autoscale/resume`)."""
    autoscale_enabled: bool = False
    """The deployment runs the autoscaler (`autoscale.enabled`); when False, resizes
    happen only through `POST /afd/scale`."""
    resizes: list[ResizeEvent] = []
    recoveries: list[RecoveryEvent] = []
    """Losses of FFN ranks and the recovery of the layout, oldest first."""
    metrics: MetricsSnapshot | None = None
    """The autoscaling signals over the coordinator's sliding window (None where no
    coordinator computed them)."""
    admission: AdmissionState | None = None
    """The answering ingress replica's admission state (added by the ingress)."""
    eplb: EPLBStatus | None = None
    """Expert load and its balance over the FFN ranks (None: no MoE load reported yet)."""
