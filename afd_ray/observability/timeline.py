"""The FFN step on the FFN rank's device timeline, split into attention, wire, FFN and idle.

On CUDA the FFN loop's calls only queue work (`cuda_ipc` queues a flag wait and copies
for A2F, compute replays CUDA graphs, F2A queues copies and a flag put) and return at
once on the host, so host times split nothing. `Clock` stamps markers on the timeline
the work runs on: on CUDA a `torch.cuda.Event(enable_timing=True)` recorded on the
current stream of the FFN rank (the one its receives, compute and sends are queued
on), whose device time is when the stream reached it; on CPU a `time.perf_counter()`
value, since CPU work is synchronous and host time is the timeline.

`StepTimeline` keeps the stamps of timed steps. Per layer `l` the FFN loop stamps
`arrived[l]` (after the A2F receives: the rows are in), `computed[l]` (after the
layer's compute) and `sent[l]` (after the F2A sends). No separate stamp marks where a
layer's wait starts: on the stream it is the previous layer's `sent` (nothing is
queued between them). The interval of a timed step, from the previous step's last
`sent` (`start`) to its own last `sent`, is split into four parts that add up to it
(each taken from the offsets of the stamps from `start`, so the sum telescopes):

    ffn_s       = Σ_l (computed[l] - arrived[l])        FFN compute, EP collectives included
    wire_s      = Σ_l (sent[l] - computed[l])           F2A copies and signal (queued on
                                                        the FFN stream)
    attention_s = Σ_{l>0} (arrived[l] - sent[l-1])      the attention rank's work of each
                                                        later layer plus its A2F, as the
                                                        FFN rank waited for it
    idle_s      = arrived[0] - start                    before the first layer's rows: the
                                                        attention rank's work before it,
                                                        sampling, scheduling, host gaps

The A2F copy is queued on the attention side's stream (into this rank's slot), and the
copy out of the slot on this rank's stream right after the flag wait: both end before
`arrived`, so A2F is inside `attention_s` (and `idle_s` for the first layer), not
`wire_s`. "Layer 0" is the first layer the step runs (`first_layer`). On CUDA a
stretch where the stream waited for this rank's host to queue the next layer also
lands in `attention_s` (or `idle_s`): the stamps see the stream, not who held it up.

A step that starts (host time) more than `IDLE_GAP_S` after the previous step ended
starts no interval: that gap is the service without work (e.g. between two loads),
not part of a step. On CPU the host gap between steps is only the attention rank's
work after the last layer and before the first; on CUDA, where the host runs ahead,
it is about one step time.

Sampling: on CPU every step is timed. On CUDA every `CUDA_SAMPLE_EVERY`-th step is
timed (3 event records per layer), and the step before it records one event at its
end, its `start`. Events are read back only once the last one completed
(`Event.query()`, no host sync): `collect` takes the completed steps in order.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

__all__ = ["CUDA_SAMPLE_EVERY", "IDLE_GAP_S", "Clock", "StepSplit", "StepTimeline"]

CUDA_SAMPLE_EVERY = 8
"""On CUDA, one step in this many is timed: keeps the ~3 event records per layer off
most steps."""
IDLE_GAP_S = 0.4
"""A step starting more than this after the previous one ended (host time) is not
timed, seconds: longer than a decode step's host gap (the H200 bench's slowest 1A:1F
step took ~0.12 s), shorter than the bench's pause between loads (>= 0.5 s,
`afd_ray.bench.runner`'s settle poll)."""
_PENDING = 64
"""Timed steps kept while their events are not complete (older ones are dropped)."""
_POOL = 1024
"""CUDA events kept for reuse (`Clock.release`)."""

Marker = torch.cuda.Event | float
"""A point on the timeline: a recorded CUDA event, or a `time.perf_counter()` value."""


class Clock:
    """Stamps on the timeline of `device`'s current stream (CUDA) or of the host (CPU).

    CUDA events are reused (`release`): a timed step stamps 3 per layer, and creating
    and destroying them is host time of the FFN loop, which on a GPU runs barely ahead
    of its device (docs/cuda.md, "Where the idle goes"), so a timed step would
    otherwise be slower than the steps it samples."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._free: list[torch.cuda.Event] = []

    def stamp(self) -> Marker:
        """A marker now: on CUDA an event recorded on `device`'s current stream (its
        time is when the stream reaches it), on CPU `time.perf_counter()`."""
        if self.cuda:
            event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def release(self, markers: list[Marker]) -> None:
        """Markers read for the last time: their events may be recorded again (at most
        `_POOL` are kept)."""
        room = _POOL - len(self._free)
        self._free += [m for m in markers[:room] if isinstance(m, torch.cuda.Event)]

    def done(self, marker: Marker) -> bool:
        """Whether `marker`'s time is known (CUDA: the event completed; never syncs)."""
        return marker.query() if isinstance(marker, torch.cuda.Event) else True

    def elapsed_s(self, start: Marker, end: Marker) -> float:
        """Seconds from `start` to `end`; on CUDA both must be `done`
        (`Event.elapsed_time` is in milliseconds)."""
        if isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event):
            return start.elapsed_time(end) / 1e3
        assert isinstance(start, float) and isinstance(end, float)
        return end - start


@dataclass(frozen=True, slots=True)
class StepSplit:
    """Sums of the four parts (module docstring) over `steps` timed steps, seconds on
    the FFN rank's timeline. Divide them by `steps` for means per step."""

    steps: int = 0
    """Timed steps summed (every step on CPU, a sample on CUDA; not a step starting
    over `IDLE_GAP_S` after the previous one)."""
    attention_s: float = 0.0
    """Waits for each later layer's rows: the attention rank's per-layer work and the
    A2F transfer."""
    wire_s: float = 0.0
    """F2A copies and signals queued on the FFN rank."""
    ffn_s: float = 0.0
    """FFN compute, EP collectives included."""
    idle_s: float = 0.0
    """Previous step's last F2A to the first layer's rows."""

    def __add__(self, other: StepSplit) -> StepSplit:
        return StepSplit(
            self.steps + other.steps,
            self.attention_s + other.attention_s,
            self.wire_s + other.wire_s,
            self.ffn_s + other.ffn_s,
            self.idle_s + other.idle_s,
        )

    def __sub__(self, other: StepSplit) -> StepSplit:
        """The growth of these sums since `other`, an earlier value of them."""
        return StepSplit(
            self.steps - other.steps,
            self.attention_s - other.attention_s,
            self.wire_s - other.wire_s,
            self.ffn_s - other.ffn_s,
            self.idle_s - other.idle_s,
        )


class StepTimeline:
    """The stamps of the timed steps of one FFN loop (one thread), and their split.

    Per step: `begin()` returns the list to append the step's stamps to (`arrived`,
    `computed`, `sent` per layer, in that order, each `clock.stamp()`), or None when
    the step is not timed; `end(marks, now_s)` closes the step. A step that begins more
    than `IDLE_GAP_S` after the previous one ended, or after `rest()` (the layout
    changed), starts no interval.

    Args:
        clock: the timeline stamped.
        every: one step in `every` is timed (>= 1).

    Raises:
        ValueError: `every` < 1.
    """

    def __init__(self, clock: Clock, every: int) -> None:
        if every < 1:
            raise ValueError(f"every: {every} < 1")
        self.clock = clock
        self._every = every
        self._count = 0
        self._start: Marker | None = None
        """The previous step's last stamp, while the current step may use it."""
        self._ended_s = 0.0
        """Host time the previous step ended (`time.perf_counter()`)."""
        self._pending: deque[tuple[Marker, list[Marker]]] = deque(maxlen=_PENDING)

    @classmethod
    def of(cls, device: torch.device) -> StepTimeline:
        """Every step on CPU, every `CUDA_SAMPLE_EVERY`-th on CUDA."""
        clock = Clock(device)
        return cls(clock, CUDA_SAMPLE_EVERY if clock.cuda else 1)

    def begin(self, now_s: float) -> list[Marker] | None:
        """Start a step at host time `now_s` (`time.perf_counter()`): an empty list to
        stamp into if it is timed, else None."""
        if now_s - self._ended_s > IDLE_GAP_S:
            self._start = None
        self._count += 1
        return [] if self._count % self._every == 0 else None

    def end(self, marks: list[Marker] | None, now_s: float) -> None:
        """Close the step `begin` opened, at host time `now_s`: keep a timed step (with
        a start) for `collect`, and stamp this step's end when the next one is timed."""
        start, self._start = self._start, None
        if marks and start is not None:
            self._pending.append((start, marks))
        if (self._count + 1) % self._every == 0:
            self._start = marks[-1] if marks else self.clock.stamp()
        self._ended_s = now_s

    def rest(self) -> None:
        """The next step starts no interval (the layout changed since this one)."""
        self._start = None

    def collect(self) -> StepSplit:
        """The split of the timed steps whose stamps completed since the last call
        (oldest first; stops at the first incomplete one)."""
        split = StepSplit()
        clock = self.clock
        while self._pending and clock.done(self._pending[0][1][-1]):
            start, marks = self._pending.popleft()
            at = [clock.elapsed_s(start, mark) for mark in marks]  # offsets from start
            # the last mark may start the next timed step (every = 1); the others and
            # this step's start are read for the last time
            clock.release([start, *marks[:-1]])
            arrived, computed, sent = at[0::3], at[1::3], at[2::3]
            split += StepSplit(
                steps=1,
                attention_s=sum(a - s for a, s in zip(arrived[1:], sent[:-1])),
                wire_s=sum(s - c for c, s in zip(computed, sent)),
                ffn_s=sum(c - a for a, c in zip(arrived, computed)),
                idle_s=arrived[0],
            )
        return split
