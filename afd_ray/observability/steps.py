"""Per-step timing records of both pools, and their join into a per-token breakdown.

Both sides keep one record per forward step in a bounded ring buffer (`StepRing`):

- the attention side (`AttentionStep`, in the vLLM worker's FFN client): when the step
  header went out, how long the step spent blocked in the FFN exchange (A2F send to
  F2A receive, summed over layers), and which requests the step served;
- the FFN side (`FFNStep`, in the FFN loop): per attention peer its header and how long
  it sat in the batching window, then the step's compute, EP collective and F2A send
  times.

The step header carries what joins them: attention rank, step id, epoch
(`afd_ray.connector.header.StepHeader`). `breakdown` splits the interval between two
consecutive steps of one attention rank (one output token of every request decoding
in that step) into five parts that add up to it:

    attention = interval - exchange
    ffn_queue, ffn_compute, ep_collective, f2a = the FFN step's parts for this peer,
        in that order, each capped by what is left of the exchange
    wire = exchange - ffn_queue - ffn_compute - ep_collective - f2a   (A2F wire/wait)

`wire` is what the attention rank waited for that the FFN rank did not account for:
the A2F transfer, and a wait for an FFN rank busy elsewhere. The caps matter when the
FFN side's times overlap the attention's own work: an F2A send (or an FFN thread not
scheduled right after it) can end after the attention rank already received the
rows and went on computing; only the exchange time is the attention rank's wait. The
split measures host time: on a transport whose waits are on the device (`cuda_ipc`),
and for a step replayed as one CUDA graph (`AttentionStep.replayed`, exchange 0), it
puts the device-side waits into `attention`; the FFN rank's device timeline
(`afd_ray.observability.timeline`) splits those steps. All times are seconds,
each measured on one side with `time.perf_counter` (no clock is compared across
processes); `start_s` is `time.time()`, for display only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from pydantic import BaseModel, ConfigDict

__all__ = ["AttentionStep", "FFNStep", "PeerStep", "StepLog", "StepRing", "TokenBreakdown", "breakdown"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class AttentionStep:
    """One forward step of one attention rank, as its FFN client saw it."""

    rank: int
    """Attention rank (`StepHeader.peer`)."""
    epoch: int
    """Epoch of the pairing the step header carried."""
    step_id: int
    start_s: float
    """`time.time()` when the step header went out (before layer 0's A2F)."""
    num_tokens: int
    exchange_s: float
    """Time blocked in the FFN exchange, summed over layers, seconds."""
    requests: tuple[str, ...]
    """vLLM engine request ids in the step's batch (`<external id>-<suffix>`)."""
    replayed: bool = False
    """The step ran as a whole-step CUDA-graph replay (`attention.cudagraph_mode:
    full_decode`): no host code ran per layer, so `exchange_s` is 0, not a measured wait."""


@dataclass(frozen=True, slots=True)
class PeerStep:
    """One attention peer's share of an FFN step."""

    rank: int
    epoch: int
    step_id: int
    num_tokens: int
    queue_s: float
    """From reading this peer's header to the start of the step's compute, seconds."""


@dataclass(frozen=True, slots=True)
class FFNStep:
    """One FFN step of one FFN rank (all layers, all its peers)."""

    epoch: int
    """FFN layout epoch."""
    start_s: float
    """`time.time()` when compute started."""
    peers: tuple[PeerStep, ...]
    compute_s: float
    """Compute of every layer, EP collectives excluded, seconds."""
    ep_s: float
    """EP collectives (step agreement, all-gather, reduce-scatter), seconds."""
    f2a_s: float
    """F2A sends, summed over layers and peers, seconds."""
    total_s: float
    """Start of compute to the last F2A sent, seconds."""
    index: int = 0
    """The step's number in its layout epoch, from 0. With EP every FFN rank of the
    layout runs every step of its group, so `(epoch, index)` names one EP step on all
    of them (`breakdown` joins their compute times)."""


class StepRing(Generic[T]):
    """The last `capacity` records, and the ones added since the last `take_new`.

    Appending is O(1) and never blocks; readers in other threads get a copy.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._ring: deque[T] = deque(maxlen=capacity)
        self._added = 0
        self._taken = 0

    def append(self, record: T) -> None:
        self._ring.append(record)
        self._added += 1

    def records(self) -> list[T]:
        """Every record held, oldest first."""
        return list(self._ring)

    def take_new(self) -> list[T]:
        """Records appended since the previous call (at most `capacity`), oldest first."""
        added = self._added
        new = min(added - self._taken, len(self._ring))
        self._taken = added
        return list(self._ring)[len(self._ring) - new :] if new else []


class TokenBreakdown(BaseModel):
    """One engine step of a request (one output token) split across the pools, seconds."""

    model_config = ConfigDict(frozen=True)

    attention_rank: int
    epoch: int
    step_id: int
    start_s: float
    """`time.time()` at the step's header (attention side)."""
    num_tokens: int
    """Token rows of the attention rank's step (its whole batch)."""
    ffn_tokens: int | None
    """Token rows of the joined FFN step, over all its peers (None: no FFN record)."""
    total_s: float
    """Interval from this step's header to the rank's next one."""
    attention_s: float
    wire_s: float
    """A2F wire/wait: exchange time the FFN rank did not account for."""
    ffn_queue_s: float
    ffn_compute_s: float
    ep_collective_s: float
    f2a_s: float
    ffn_rank_compute_s: dict[int, float] = {}
    """With EP: the compute of the same EP step on each FFN rank of the layout (by FFN
    rank, EP collectives excluded), seconds. The slowest is the straggler the others
    waited for in their EP collectives (EPLB, docs/eplb.md); empty without EP or
    without the other ranks' records."""


def breakdown(
    request_id: str, attention: Iterable[AttentionStep], ffn: Iterable[FFNStep] | Mapping[int, Iterable[FFNStep]]
) -> list[TokenBreakdown]:
    """The steps that served `request_id`, each split as the module docstring says;
    `ffn`: the FFN ranks' records by FFN rank (with EP, each step then has every
    rank's compute of that EP step, `TokenBreakdown.ffn_rank_compute_s`), or all of
    them without their ranks.

    A step is kept when one of its engine request ids is `request_id` or starts with
    `request_id + "-"` (vLLM appends a suffix to the OpenAI id), and the same rank's
    next step (step id + 1, same epoch), which ends its interval, served the request
    too: the request's last step is left out, as its interval may run into idle time.
    A step without a joined FFN record (evicted from the FFN ring) has its whole
    exchange in `wire_s`.
    """
    by_attention: dict[int, dict[tuple[int, int], AttentionStep]] = {}
    for step in attention:
        by_attention.setdefault(step.rank, {})[(step.epoch, step.step_id)] = step
    by_rank = ffn if isinstance(ffn, Mapping) else {None: ffn}
    peers: dict[tuple[int, int, int], tuple[FFNStep, PeerStep]] = {}
    ep_steps: dict[tuple[int, int], dict[int, float]] = {}
    """`(epoch, index)` -> FFN rank -> its compute of that step."""
    for ffn_rank, steps in by_rank.items():
        for step in steps:
            for peer in step.peers:
                peers[(peer.rank, peer.epoch, peer.step_id)] = (step, peer)
            if ffn_rank is not None:
                ep_steps.setdefault((step.epoch, step.index), {})[ffn_rank] = step.compute_s
    prefix = request_id + "-"

    def served(step: AttentionStep | None) -> bool:
        return step is not None and any(r == request_id or r.startswith(prefix) for r in step.requests)

    out = []
    for rank, steps in sorted(by_attention.items()):
        for (epoch, step_id), step in sorted(steps.items()):
            following = steps.get((epoch, step_id + 1))
            if not (served(step) and served(following)):
                continue
            assert following is not None
            joined = peers.get((rank, epoch, step_id))
            split = _split(step, following.start_s - step.start_s, joined)
            ranks = ep_steps.get((joined[0].epoch, joined[0].index), {}) if joined is not None else {}
            if len(ranks) > 1:  # EP: every rank's compute of that step
                split = split.model_copy(update={"ffn_rank_compute_s": dict(sorted(ranks.items()))})
            out.append(split)
    return sorted(out, key=lambda b: b.start_s)


def _split(step: AttentionStep, total_s: float, joined: tuple[FFNStep, PeerStep] | None) -> TokenBreakdown:
    queue = compute = ep = f2a = 0.0
    ffn_tokens = None
    if joined is not None:
        ffn_step, peer = joined
        left, capped = step.exchange_s, []
        for part in (peer.queue_s, ffn_step.compute_s, ffn_step.ep_s, ffn_step.f2a_s):
            capped.append(min(part, left))
            left -= capped[-1]
        queue, compute, ep, f2a = capped
        ffn_tokens = sum(p.num_tokens for p in ffn_step.peers)
    return TokenBreakdown(
        attention_rank=step.rank,
        epoch=step.epoch,
        step_id=step.step_id,
        start_s=step.start_s,
        num_tokens=step.num_tokens,
        ffn_tokens=ffn_tokens,
        total_s=total_s,
        attention_s=max(total_s - step.exchange_s, 0.0),
        wire_s=max(step.exchange_s - queue - compute - ep - f2a, 0.0),
        ffn_queue_s=queue,
        ffn_compute_s=compute,
        ep_collective_s=ep,
        f2a_s=f2a,
    )


class StepLog:
    """The coordinator's bounded store of both pools' step records, for `breakdown`.

    Args:
        capacity: records kept per rank and side (oldest dropped first).
    """

    def __init__(self, capacity: int = 8192) -> None:
        self._capacity = capacity
        self._attention: dict[int, deque[AttentionStep]] = {}
        self._ffn: dict[int, deque[FFNStep]] = {}

    def add_attention(self, rank: int, steps: Iterable[AttentionStep]) -> None:
        """Keep attention rank `rank`'s new records."""
        self._attention.setdefault(rank, deque(maxlen=self._capacity)).extend(steps)

    def add_ffn(self, rank: int, steps: Iterable[FFNStep]) -> None:
        """Keep FFN rank `rank`'s new records."""
        self._ffn.setdefault(rank, deque(maxlen=self._capacity)).extend(steps)

    def breakdown(self, request_id: str) -> list[TokenBreakdown]:
        """`breakdown` of `request_id` over every record held."""
        attention = [step for ring in self._attention.values() for step in ring]
        return breakdown(request_id, attention, self._ffn)
