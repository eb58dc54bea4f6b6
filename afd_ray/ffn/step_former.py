"""Step forming (M:N fan-in): which attention peers take part in the next FFN step.

After the first STEP header, the former keeps reading headers for up to
`batch_window_s` or until every admitted peer has announced a step, then hands the
loop one `FormedStep` for all of them. A slow or idle peer delays the others by at
most the window; it joins the next step. JOIN/LEAVE headers read meanwhile travel
with the step, to be applied after it, at the step boundary.

A STEP header that cannot join the forming step closes it and starts the next one
(it is deferred):
- a header of another `first_layer` (a step resumed on this rank after its peer lost
  its FFN rank): the STEP headers of one step share their `first_layer`;
- a second STEP header of a peer already in the step: on CUDA an attention rank's
  host runs ahead of its device and may announce its next step before this one ran.

So no peer ever has two steps in one FFN step, and its device work (CUDA) or its
host (CPU) waits for one step's last F2A before that step's rows of the next (rule 2
of `afd_ray.connector.channel`): a formed step cannot wait on itself.

With EP every rank runs the same layers: the group agrees on one `first_layer` per
step (`EPGroup.agree`), and a rank whose step starts elsewhere runs that one without
rows; its own step is held (`hold`) and formed again at the next agreement.

Idle backoff: the first header is awaited `poll_s`, and the wait doubles with every
idle round (`pace(False)`) up to `idle_poll_s`; with EP an idle rank checks in with
its group after each wait, so an idle EP group does not spin through an all-reduce
every 2 ms, and the first step after an idle spell waits at most `idle_poll_s` for
the idle ranks.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from afd_ray.connector.header import HeaderKind, StepHeader
from afd_ray.connector.link import FFNLink
from afd_ray.observability.steps import PeerStep

__all__ = ["FormedStep", "StepFormer"]


@dataclass(frozen=True)
class FormedStep:
    """What one loop iteration serves: a step's STEP headers and the JOIN/LEAVE headers
    to apply at its boundary (either may be empty)."""

    steps: tuple[StepHeader, ...] = ()
    """The STEP headers of the step, one per peer, in peer order (all of one `first_layer`)."""
    arrived: Mapping[int, float] = field(default_factory=dict)
    """When each peer's STEP header was read, by peer (`time.perf_counter()`)."""
    membership: tuple[StepHeader, ...] = ()
    """JOIN/LEAVE headers read while forming, in arrival order."""

    @property
    def first_layer(self) -> int:
        """The layer the step starts at (0 when there is no step)."""
        return self.steps[0].first_layer if self.steps else 0

    @property
    def tokens(self) -> int:
        """Token rows of the step, over its peers."""
        return sum(step.num_tokens for step in self.steps)

    def ubatches(self, count: int) -> list[tuple[StepHeader, ...]]:
        """The step's peers in `min(count, len(steps))` ubatches (at least one, possibly
        empty: an EP rank without local rows), dealt round robin in peer order."""
        count = max(1, min(count, len(self.steps)))
        return [self.steps[i::count] for i in range(count)]

    def peer_steps(self, start_s: float) -> tuple[PeerStep, ...]:
        """Each peer's share of the step for its timing record, queued from its header to
        `start_s` (`time.perf_counter()`, the start of the step's compute)."""
        return tuple(
            PeerStep(step.peer, step.epoch, step.step_id, step.num_tokens, start_s - self.arrived[step.peer])
            for step in self.steps
        )


class StepFormer:
    """Forms the FFN steps of one `FFNLink` from the headers its peers send (module
    docstring).

    Args:
        channel: the FFN side of the connector.
        batch_window_s: longest wait for more peers once one peer's STEP header
            arrived, seconds.
        poll_s: longest wait for a first header, seconds (the loop then checks its
            stop flag, and an EP rank checks in with its group); a header wakes it at once.
        idle_poll_s: the longest such wait after idle rounds (doubling from `poll_s`),
            seconds; None: `poll_s` (no backoff).
    """

    def __init__(self, channel: FFNLink, batch_window_s: float, poll_s: float, idle_poll_s: float | None) -> None:
        self._channel = channel
        self._batch_window_s = batch_window_s
        self._poll_s = poll_s
        self._idle_poll_s = max(poll_s, idle_poll_s or poll_s)
        self._wait_s = poll_s
        """The current wait for a first header: `poll_s` after activity, doubling while idle."""
        self._deferred: StepHeader | None = None
        """A STEP read while forming a step it cannot join: it starts the next one."""
        self._held: FormedStep | None = None
        """A formed step the EP group did not run (it agreed on another `first_layer`)."""

    def next(self) -> FormedStep:
        """The next step: a held one, else one formed from the headers read now (empty
        when none came within the current wait)."""
        if self._held is not None:
            held, self._held = self._held, None
            return held
        header, self._deferred = self._deferred or self._channel.recv_header(self._wait_s), None
        if header is None:
            return FormedStep()
        if header.kind is not HeaderKind.STEP:
            return FormedStep(membership=(header,))
        return self._form(header)

    def hold(self, step: FormedStep) -> None:
        """Serve `step`'s STEP headers again at the next `next()` (its JOIN/LEAVE are
        applied at this boundary)."""
        self._held = replace(step, membership=())

    def reset(self) -> None:
        """Forget a held and a deferred step (the EP group failed: every pair is closed)."""
        self._held, self._deferred = None, None

    def pace(self, active: bool) -> None:
        """After an iteration: wait `poll_s` for the next first header if it did
        anything (`active`), else twice the last wait, at most `idle_poll_s`."""
        self._wait_s = self._poll_s if active else min(2 * self._wait_s, self._idle_poll_s)

    def _form(self, first: StepHeader) -> FormedStep:
        """The step `first` opens: the STEP headers read within the batching window that
        can join it, and the JOIN/LEAVE read meanwhile."""
        steps = {first.peer: first}
        arrived = {first.peer: time.perf_counter()}
        membership: list[StepHeader] = []
        deadline = arrived[first.peer] + self._batch_window_s
        while len(steps) < len(self._channel.peers):
            header = self._channel.recv_header(max(deadline - time.perf_counter(), 0.0))
            if header is None:
                break
            if header.kind is HeaderKind.STEP and (header.first_layer != first.first_layer or header.peer in steps):
                self._deferred = header
                break
            if header.kind is HeaderKind.STEP:
                steps[header.peer] = header
                arrived[header.peer] = time.perf_counter()
            else:
                membership.append(header)
        return FormedStep(tuple(steps[peer] for peer in sorted(steps)), arrived, tuple(membership))
