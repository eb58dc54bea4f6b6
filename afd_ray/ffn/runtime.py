"""The FFN runtime: a loop driven by the connector, with no scheduler and no KV cache.

The runtime talks to its peers only through the connector contract (`FFNLink`,
`afd_ray.connector.link`), whatever the transport of each pair.

Each iteration: read one step header; JOIN/LEAVE change the peer set at this step
boundary; STEP headers form one step for every peer taking part, which runs every
FFN layer in order (from the headers' `first_layer`): receive `[T_i, H]` from each
peer (A2F), compute on all rows at once, send each peer its `[T_i, H]` back (F2A).
The loop owns nothing across steps except the weights and the counters in
`afd_ray.observability.stats.FFNStats`, so a lost FFN rank loses no request data.

A new FFN layout (a resize of the FFN pool) is prepared outside the loop (new expert
shard loaded, new EP group opened) and handed over with `prepare_switch`; the loop
switches model, EP group and epoch together at the first step boundary at which every
rank of its current EP group has its switch prepared (agreed in `EPGroup.agree`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from afd_ray.connector.header import HeaderKind, StepHeader
from afd_ray.connector.link import FFNLink, PeerLostError
from afd_ray.ffn.ep import EPGroup
from afd_ray.ffn.graphs import DEFAULT_BUCKETS, FFNGraphs, StepInputs, graphs_supported
from afd_ray.ffn.model import FFNStack
from afd_ray.observability.stats import FFNStats
from afd_ray.observability.steps import FFNStep, PeerStep, StepRing
from afd_ray.observability.timeline import StepTimeline

__all__ = ["FFNRuntime", "LayoutSwitch"]

logger = logging.getLogger(__name__)

_LAYOUT_POLL_S = 0.05
"""While the EP group is lost: how often the loop checks for the next layout, seconds."""


@dataclass(frozen=True)
class LayoutSwitch:
    """A prepared FFN layout for `FFNRuntime.prepare_switch`."""

    epoch: int
    """Layout epoch served after the switch."""
    model: FFNStack
    """The FFN blocks of the new layout (this rank's new expert shard)."""
    ep: EPGroup | None
    """The new layout's EP group, or None for a single FFN rank (or a dense model)."""
    leave: bool = False
    """This rank leaves the layout: it serves no step after the switch."""


class FFNRuntime:
    """Serves the FFN half of every layer to the attention peers of one `FFNLink`.

    Step forming (M:N fan-in): after the first STEP header, the runtime keeps reading
    headers for up to `batch_window_s` or until every admitted peer has announced a
    step, then runs one step for all of them: per layer it receives each peer's
    `[T_i, H]`, computes on the concatenation `[ΣT_i, H]`, and sends each peer its
    rows back, in peer order. A slow or idle peer delays the others by at most the
    window; it joins the next step. JOIN/LEAVE read while forming a step are applied
    after it, at the step boundary. The STEP headers of one step share their
    `first_layer`; a header with another one (a step resumed on this rank after
    its peer lost its FFN rank) starts the next step instead, and so does a second
    STEP header of a peer already in the step: on CUDA an attention rank's host runs
    ahead of its device and may announce its next step before this one ran. With EP
    every rank must run the same layers: the group agrees on one `first_layer` per
    step (`EPGroup.agree`), and a rank whose step starts elsewhere runs that one
    without rows and its own at the next agreement. No peer ever has two steps in one
    FFN step, and its device work (CUDA) or its host (CPU) waits for one step's last
    F2A before that step's rows of the next (rule 2 of `afd_ray.connector.channel`),
    so a formed step cannot wait on itself.

    Failures (docs/failures.md): an attention peer lost inside a step gets nothing more;
    the step runs to its end for the others (its rows zeroed; with EP the other
    ranks wait for this one in every layer) and its pair is closed at the boundary.
    A failed EP collective (an EP rank died) closes every attention pair, so the
    attention ranks fail at once and wait for their re-peering, and the loop serves
    nothing until the coordinator's re-formed layout is handed over
    (`prepare_switch`), which it switches to at once; past `ep_lost_wait_s` the loop
    ends (the coordinator then replaces this rank too).

    With an EP group (F > 1 FFN ranks), every FFN rank runs every step (lockstep,
    `afd_ray.ffn.ep`): after forming its local step it all-reduces its token count
    with the others, and runs the layers, with no local rows if need be, whenever any
    rank has tokens. An idle rank checks in after `poll_s`, and the wait doubles
    with every idle round up to `idle_poll_s` (the first step after an idle spell
    waits at most that long for the idle ranks; a busy group checks in every
    `poll_s`): an idle EP group no longer spins through an all-reduce every 2 ms.
    Every EP rank pads its rows to the same count, at least the largest local one
    (`EPGroup.moe`).

    Stream (CUDA): the loop queues its receives, compute and sends on a non-blocking
    stream of its own, never on the legacy default stream, which waits for (and is
    waited on by) every blocking stream's work: a pair opened at a step boundary
    (`afd_ray.connector.cuda_ipc`) must not queue behind the device-side flag waits of
    the steps in flight, nor they behind its setup. Tensors made by other threads (the
    weights, `expert_tokens`, a prepared layout) are made on the legacy default stream:
    the loop's stream waits for it when the loop starts and at each layout switch, and
    makes it wait for the old layout's last step before dropping that layout (so that
    its freed memory is reused only after that step).

    Compute runs through `FFNGraphs`, built at the first step of each layout (with
    EP every rank of the group is in that step): on CUDA (`graphs.graphs_supported`)
    it captures every layer as a CUDA graph per bucket of padded rows, and steps
    larger than every bucket run eagerly; on CPU every step runs eagerly on exactly
    its rows.

    Args:
        model: the FFN blocks of every layer (an EP shard of the experts with EP),
            on `device`, in the model dtype.
        channel: the FFN side of the connector (any transport).
        dtype: dtype of the A2F/F2A tensors (the model dtype).
        poll_s: longest wait for a header before the stop flag is checked (and, with
            EP, before an idle rank checks in with its group), seconds; a header
            wakes the loop at once.
        idle_poll_s: the longest such wait after idle rounds (doubling from
            `poll_s`), seconds; None: `poll_s` (no backoff). It also bounds how long
            `stop()` takes.
        batch_window_s: longest wait for more peers once one peer's step header
            arrived, seconds.
        ep: the EP group among FFN ranks, or None for a single FFN rank.
        epoch: the layout epoch this rank starts in.
        graph_buckets: padded token counts per FFN rank captured as CUDA graphs.
        step_records: FFN steps kept in `steps` (a ring buffer).
        ep_lost_wait_s: how long a rank whose EP group failed waits for the re-formed
            layout (`prepare_switch`) before its loop ends, seconds.
        ubatches: DBO across attention ranks: a step's peers are served in up to this
            many groups (ubatches) per layer, one after the other, so that one group's
            attention runs while this rank computes another's (`FFNPoolConfig.ubatches`).
            With EP a step runs as one ubatch.

    Raises:
        ValueError: `ubatches` < 1.

    Timing records: every step appends an `FFNStep` to `steps` (per peer its header
    and batching-window wait; compute, EP collective and F2A send times), read by the
    FFN server for metrics and per-token breakdowns (`afd_ray.observability.steps`).
    With EP, the step agreement all-reduce counts as batching-window wait. On CUDA the
    times are host times of asynchronous launches.

    Step split (`FFNStats.split`, `afd_ray.observability.timeline`): per layer the
    loop stamps when the rows arrived, when compute ended and when the F2A sends ended,
    on the device timeline (CUDA events on this rank's stream; `time.perf_counter` on
    CPU), and splits the interval from the previous step's end to this step's end into
    attention, wire, FFN and idle. Every step is timed on CPU, one in
    `timeline.CUDA_SAMPLE_EVERY` on CUDA; events are read back once complete, never
    with a host sync. A step that starts more than `timeline.IDLE_GAP_S` after the
    previous one ended (host time), the first after a layout switch and the first
    after an EP failure are not timed: their interval is the service idle or a
    rebuild, not a step.
    """

    def __init__(
        self,
        model: FFNStack,
        channel: FFNLink,
        dtype: torch.dtype,
        poll_s: float,
        batch_window_s: float,
        ep: EPGroup | None = None,
        epoch: int = 0,
        graph_buckets: Sequence[int] = DEFAULT_BUCKETS,
        step_records: int = 4096,
        ep_lost_wait_s: float = 120.0,
        idle_poll_s: float | None = None,
        ubatches: int = 1,
    ) -> None:
        self.model = model
        self.channel = channel
        self.ep = ep
        self.stats = FFNStats()
        self.steps: StepRing[FFNStep] = StepRing(step_records)
        """The last `step_records` steps' timing records."""
        self.epoch = epoch
        """Layout epoch this rank serves."""
        self.left = False
        """This rank left the layout (it serves no step any more)."""
        self._pending: LayoutSwitch | None = None
        self._closed = False
        """`run()` ended and closed its groups: a layout handed over later is closed at once."""
        self._pending_lock = threading.Lock()
        """Orders `prepare_switch` against the closing of the groups at the end of `run()`."""
        self._dead: frozenset[int] = frozenset()
        self._pause_s = 0.0
        self._dtype = dtype
        self._poll_s = poll_s
        self._idle_poll_s = max(poll_s, idle_poll_s or poll_s)
        self._wait_s = poll_s
        """The current header wait: `poll_s` after activity, doubling while idle."""
        self._batch_window_s = batch_window_s
        self._device = next(model.parameters()).device
        self._timeline = StepTimeline.of(self._device)
        """Device-timeline stamps of timed steps: `FFNStats.split`."""
        self._stop = threading.Event()
        moe = model.moe_blocks
        num_experts = moe[0].spec.num_experts if moe else 0
        self.expert_tokens = torch.zeros(num_experts, dtype=torch.int64, device=self._device)
        """Rows this rank's tokens routed to each expert `[E]` int64, summed over MoE
        layers and steps (expert load; updated in place, on the model's device; on CUDA
        a read from another thread does not wait for the steps in flight)."""
        self._stream = torch.cuda.Stream(self._device) if self._device.type == "cuda" else None
        """The loop's non-blocking CUDA stream (None on CPU)."""
        self._graph_buckets = tuple(graph_buckets)
        self._compute: FFNGraphs | None = None
        self._deferred: StepHeader | None = None
        """A STEP read while forming a step of another `first_layer`: starts the next."""
        self._held: tuple[list[StepHeader], dict[int, float]] | None = None
        """A formed step the EP group did not run (it agreed on another `first_layer`)."""
        self._ep_lost_wait_s = ep_lost_wait_s
        if ubatches < 1:
            raise ValueError(f"ubatches: {ubatches} < 1")
        self._ubatches = ubatches
        self._ep_lost_at: float | None = None
        """When the EP group failed (`time.monotonic()`); None while it serves."""

    def run(self) -> None:
        """Serve headers until `stop()`; then close the channel and the EP groups (the
        serving one and a prepared one), so that the other EP ranks' collectives fail
        at once instead of waiting out their timeout for a rank that is gone (same
        thread). On CUDA everything is queued on the loop's own stream.

        Raises:
            RuntimeError: the EP group failed and no new layout was handed over within
                `ep_lost_wait_s` (the coordinator then finds this rank's loop stopped).
        """
        if self._stream is None:
            self._serve()
            return
        self._stream.wait_stream(torch.cuda.default_stream(self._device))  # tensors made by other threads
        with torch.cuda.stream(self._stream):
            self._serve()

    def _serve(self) -> None:
        """The loop of `run()`, on the current stream."""
        try:
            while not self._stop.is_set():
                if self._ep_lost_at is not None and not self._await_layout():
                    continue
                steps, arrived = self._held or ([], {})
                self._held = None
                membership: list[StepHeader] = []
                if not steps:
                    header, self._deferred = self._deferred or self.channel.recv_header(self._wait_s), None
                    if header is not None and header.kind is HeaderKind.STEP:
                        steps, membership, arrived = self._form_step(header)
                    elif header is not None:
                        membership.append(header)
                pending = self._pending
                first_layer = steps[0].first_layer if steps else 0
                lost: set[int] = set()
                if self.ep is None:
                    switch = pending is not None
                    if steps and not self.left:
                        lost = self._step(steps, arrived, first_layer)
                else:  # an EP rank with no local step still runs the group's layers
                    switch, lost = self._ep_step(steps, arrived, first_layer, pending is not None)
                start = time.perf_counter()
                for change in membership:
                    self._apply(change)
                dead = self._dead.intersection(self.channel.peers) | lost
                for peer in dead:
                    self.channel.remove(peer)
                    logger.warning("FFN dropped attention rank %d: it vanished without LEAVE", peer)
                if switch and pending is not None:
                    self._switch(pending)
                if membership or switch or dead:
                    self._pause_s = max(self._pause_s, time.perf_counter() - start)
                group_stepped = self.ep is not None and any(self.ep.step_tokens)
                active = bool(steps or membership or dead) or pending is not None or group_stepped
                self._wait_s = self._poll_s if active else min(2 * self._wait_s, self._idle_poll_s)
                if not active:
                    self._count_split()  # a timed step's events completed meanwhile
        finally:
            self.channel.close()
            self._close_groups()

    def _close_groups(self) -> None:
        """Shut down the serving EP group and a prepared one, if any, and drop every
        reference to them: a gloo group closes its connections (the other ranks'
        collectives fail with "connection closed") only once it is destroyed;
        `shutdown()` alone leaves them waiting out the timeout. A layout handed over
        after this (its preparation ended after the loop) is closed by
        `prepare_switch`."""
        with self._pending_lock:
            pending, self._pending, self._closed = self._pending, None, True
        _shutdown(self.ep, pending.ep if pending is not None else None)
        self.ep, self._compute = None, None  # FFNGraphs holds the serving group too

    def _ep_step(
        self, steps: list[StepHeader], arrived: dict[int, float], first_layer: int, ready: bool
    ) -> tuple[bool, set[int]]:
        """Agree on the next step with the EP group and run it; returns whether the
        group switches layout after it, and the attention peers lost during it. A step
        of this rank that starts at another layer than the group's waits (`_held`) for
        a later agreement. A failed collective (an EP rank died, or the group timed
        out) drops every attention pair, so their ranks fail at once and wait for
        their re-peering, and the loop waits for the next layout (`_await_layout`)."""
        assert self.ep is not None
        try:
            tokens = sum(step.num_tokens for step in steps)
            run_step = self.ep.agree(tokens, ready, first_layer) > 0
            if steps and self.ep.step_tokens[self.ep.rank] == 0:
                self._held = (steps, arrived)
                steps = []
            lost = self._step(steps, arrived, self.ep.first_layer) if run_step and not self.left else set()
            return self.ep.all_ready, lost
        except RuntimeError as exc:  # PeerLostError of an attention peer is handled in _step
            self._lose_ep(exc)
            return False, set()

    def _lose_ep(self, exc: RuntimeError) -> None:
        """The EP group failed: close every attention pair and the group; the rank
        serves nothing until a new layout is handed over."""
        assert self.ep is not None
        logger.warning("FFN EP group of epoch %d failed (%s); waiting for the re-formed layout", self.epoch, exc)
        for peer in self.channel.peers:
            self.channel.remove(peer)
        self._held, self._deferred, self._compute = None, None, None
        self._timeline.rest()
        group, self.ep = self.ep.group, None
        try:
            group.shutdown()
        except RuntimeError:
            logger.debug("shutting down the failed EP group raised", exc_info=True)
        self._ep_lost_at = time.monotonic()

    def _await_layout(self) -> bool:
        """While the EP group is lost: switch to the next layout once it is handed over
        (True: serve again), else wait one poll (False).

        Raises:
            RuntimeError: none came within `ep_lost_wait_s` of the loss.
        """
        assert self._ep_lost_at is not None
        pending = self._pending
        if pending is not None:
            self._switch(pending)
            self._pause_s = max(self._pause_s, time.monotonic() - self._ep_lost_at)
            self._ep_lost_at = None
            return True
        if time.monotonic() - self._ep_lost_at > self._ep_lost_wait_s:
            raise RuntimeError(f"FFN EP group lost and no new layout within {self._ep_lost_wait_s} s")
        self._stop.wait(_LAYOUT_POLL_S)
        return False

    @property
    def ep_lost(self) -> bool:
        """Its EP group failed and the re-formed layout has not been handed over yet:
        the loop serves nothing meanwhile."""
        return self._ep_lost_at is not None

    def stop(self) -> None:
        """Ask `run()` to return within one poll interval."""
        self._stop.set()

    def prepare_switch(self, switch: LayoutSwitch) -> None:
        """Hand over a prepared layout; `run()` switches to it at the first step
        boundary where every rank of the current EP group has one (thread-safe).
        Once `run()` has ended, its EP group is shut down at once instead (and no
        reference kept), so the other ranks of that layout fail over rather than
        wait out its timeout for this rank."""
        with self._pending_lock:
            if not self._closed:
                self._pending = switch
                return
        logger.warning("FFN layout of epoch %d handed over after the loop ended: its EP group is closed",
                       switch.epoch)  # fmt: skip
        _shutdown(switch.ep)

    def drop_peers(self, peers: list[int]) -> None:
        """Attention peers that died without LEAVE: `run()` removes their pairs at the
        next step boundary, so steps stop waiting for them (thread-safe)."""
        self._dead = frozenset(peers)

    def take_pause(self) -> float:
        """Longest step-boundary pause (admitting or removing peers, switching the
        layout) since the previous call, seconds."""
        pause, self._pause_s = self._pause_s, 0.0
        return pause

    def _switch(self, switch: LayoutSwitch) -> None:
        """Serve the layout of `switch` from the next step on; the old EP group is
        destroyed here, its tensors are freed with the old model."""
        old = self.ep
        if self._stream is not None:  # the old layout's memory is reused after its last step; the new one is made
            torch.cuda.default_stream(self._device).wait_stream(self._stream)
            self._stream.wait_stream(torch.cuda.default_stream(self._device))
        self.model, self.ep, self.epoch, self.left = switch.model, switch.ep, switch.epoch, switch.leave
        self.channel.epoch = switch.epoch
        self._pending = None
        self._timeline.rest()
        self._compute = None  # its CUDA graphs captured the old EP group: free them before its shutdown
        if old is not None and old is not switch.ep:
            old.group.shutdown()
        logger.info(
            "FFN switched to the layout of epoch %d (%s)", switch.epoch,
            "left" if switch.leave else f"EP {switch.ep.rank}/{switch.ep.size}" if switch.ep else "no EP",
        )

    def _form_step(
        self, first: StepHeader
    ) -> tuple[list[StepHeader], list[StepHeader], dict[int, float]]:
        """The STEP headers of this step (peer order), the JOIN/LEAVE read meanwhile,
        and when each peer's header was read (`time.perf_counter()`). A STEP header
        that cannot join this step (another `first_layer`, or a peer's next step) is
        kept for the next one, and this one closes."""
        steps = {first.peer: first}
        arrived = {first.peer: time.perf_counter()}
        membership: list[StepHeader] = []
        deadline = arrived[first.peer] + self._batch_window_s
        while len(steps) < len(self.channel.peers):
            left = deadline - time.perf_counter()
            header = self.channel.recv_header(max(left, 0.0))
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
        return [steps[peer] for peer in sorted(steps)], membership, arrived

    def _layout_compute(self) -> FFNGraphs:
        """The compute of the current model and EP group, built (graphs captured) at
        the first step that uses them."""
        compute = self._compute
        if compute is None or compute.model is not self.model or compute.ep is not self.ep:
            if self._ubatches > 1 and self.ep is not None:
                logger.warning("ffn.ubatches %d has no effect in this layout: with EP (%d FFN ranks) a step runs "
                               "as one ubatch", self._ubatches, self.ep.size)  # fmt: skip
            buckets = self._graph_buckets if graphs_supported(self.model, self._dtype) else ()
            compute = self._compute = FFNGraphs(self.model, self.ep, self._dtype, buckets)
        return compute

    def _apply(self, header: StepHeader) -> None:
        """Admit a JOIN's peer, or remove a LEAVE's. A peer that cannot be admitted
        (it died before the rendezvous, or announced a transport this rank cannot
        serve) is logged and skipped: the loop keeps serving the others."""
        if header.kind is HeaderKind.JOIN:
            try:
                self.channel.admit(header.peer)
            except (PeerLostError, ValueError) as exc:
                logger.warning("FFN did not admit attention rank %d (epoch %d): %s", header.peer, header.epoch, exc)
                return
            logger.info("FFN admitted attention rank %d (epoch %d)", header.peer, header.epoch)
        else:
            self.channel.remove(header.peer)
            logger.info("attention rank %d left (epoch %d)", header.peer, header.epoch)

    @torch.inference_mode()
    def _step(self, steps: list[StepHeader], arrived: dict[int, float], first_layer: int) -> set[int]:
        """Run the layers from `first_layer` for `steps`; returns the attention peers
        lost on the way. A lost peer's rows are zeroed and it gets nothing more, but the
        step runs to its end: with EP the other ranks wait for this one in every layer.

        Raises:
            RuntimeError: an EP collective failed (not a `PeerLostError`).
        """
        start = time.perf_counter()
        wall = time.time()
        ep_before = self.ep.collective_s if self.ep is not None else 0.0
        compute_s = f2a_s = 0.0
        f2a_bytes = 0  # [T_i, H] or [T_i, P, H] per peer and layer, as sent
        compute = self._layout_compute()
        tokens = sum(step.num_tokens for step in steps)
        ubatches = _ubatches(steps, self._ubatches if self.ep is None else 1)
        groups = [self._ubatch(compute, group) for group in ubatches]
        layers = range(first_layer, self.model.num_layers)
        lost: set[int] = set()
        timeline = self._timeline
        marks = timeline.begin(start)  # arrived, computed, sent per layer and ubatch on a timed step
        for layer in layers:
            for group, inputs, sizes, hidden, topk in groups:
                rows = sum(sizes)
                for step, peer_rows, peer_topk in zip(group, hidden, topk):
                    if step.peer in lost:
                        continue
                    try:
                        self.channel.recv_a2f(step.peer, peer_rows, peer_topk)
                    except PeerLostError as exc:
                        self._lost(step.peer, layer, exc, lost)
                        for part in (peer_rows, *(peer_topk or ())):
                            part.zero_()  # finite rows for the rest of the step (expert 0, weight 0)
                if marks is not None:
                    marks.append(timeline.clock.stamp())
                computing = time.perf_counter()
                out, routed = compute.run(layer, inputs)  # [R, H] or [R, P, H]; [R, k] int64 for an MoE layer
                if routed is not None:
                    routed = routed[:rows].flatten()  # [rows*k]
                    self.expert_tokens.index_add_(0, routed, torch.ones_like(routed))
                if marks is not None:
                    marks.append(timeline.clock.stamp())
                sending = time.perf_counter()
                compute_s += sending - computing
                for step, peer_out in zip(group, out[:rows].split(sizes)):
                    if step.peer not in lost:
                        try:
                            self.channel.send_f2a(step.peer, peer_out)
                            f2a_bytes += peer_out.nbytes
                        except PeerLostError as exc:
                            self._lost(step.peer, layer, exc, lost)
                if marks is not None:
                    marks.append(timeline.clock.stamp())
                f2a_s += time.perf_counter() - sending
        timeline.end(marks, time.perf_counter())
        row_bytes = self.model.hidden_size * self._dtype.itemsize  # one [H] row, one way
        layer_bytes = tokens * row_bytes  # [ΣT_i, H] one way, one layer
        routing = groups[0].inputs.routing  # ids [R, k] int64, weights [R, k] float32
        topk_bytes = tokens * sum(t.shape[1] * t.element_size() for t in routing) if routing is not None else 0
        end = time.perf_counter()
        ep_s = self.ep.collective_s - ep_before if self.ep is not None else 0.0
        peers = tuple(
            PeerStep(step.peer, step.epoch, step.step_id, step.num_tokens, start - arrived[step.peer]) for step in steps
        )
        self.steps.append(FFNStep(self.epoch, wall, peers, max(compute_s - ep_s, 0.0), ep_s, f2a_s, end - start))
        stats = self.stats
        self.stats = replace(
            stats,
            steps=stats.steps + 1,
            layers=stats.layers + len(layers),
            tokens=stats.tokens + tokens,
            busy_s=stats.busy_s + end - start,
            a2f_bytes=stats.a2f_bytes + (layer_bytes + topk_bytes) * len(layers),
            f2a_bytes=stats.f2a_bytes + f2a_bytes,
            split=stats.split + timeline.collect(),
        )
        return lost

    def _count_split(self) -> None:
        """Count the timed steps whose stamps completed since the last step."""
        split = self._timeline.collect()
        if split.steps:
            self.stats = replace(self.stats, split=self.stats.split + split)

    def _ubatch(self, compute: FFNGraphs, group: list[StepHeader]) -> _Ubatch:
        """A ubatch of `group`'s peers and the views its rows go to, made once per step.
        With EP the buffers hold the group's padded rows (the largest local count, the
        same on every EP rank)."""
        sizes = [step.num_tokens for step in group]
        inputs = compute.inputs(sum(sizes) if self.ep is None else max(self.ep.step_tokens))
        rows = sum(sizes)
        hidden = inputs.hidden[:rows].split(sizes)
        if inputs.routing is None:
            topk: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(group)
        else:
            topk = list(zip(*(t[:rows].split(sizes) for t in inputs.routing)))
        return _Ubatch(group, inputs, sizes, hidden, topk)

    @staticmethod
    def _lost(peer: int, layer: int, exc: PeerLostError, lost: set[int]) -> None:
        logger.warning("FFN lost attention rank %d at layer %d (%s); the step goes on without it", peer, layer, exc)
        lost.add(peer)


class _Ubatch(NamedTuple):
    """One ubatch of a step: its peers (`steps`), the buffers their rows go to, each
    peer's rows `T_i`, and per peer the views `[T_i, H]` into `inputs.hidden` and, with
    `gate_on_attention`, the top-k ids and weights `[T_i, k]` into `inputs.routing`."""

    steps: list[StepHeader]
    inputs: StepInputs
    sizes: list[int]
    hidden: tuple[torch.Tensor, ...]
    topk: list[tuple[torch.Tensor, torch.Tensor] | None]


def _ubatches(steps: list[StepHeader], count: int) -> list[list[StepHeader]]:
    """The step's peers in `min(count, len(steps))` ubatches (at least one, possibly
    empty: an EP rank without local rows), dealt round robin in peer order."""
    count = max(1, min(count, len(steps)))
    return [steps[i::count] for i in range(count)]


def _shutdown(*groups: EPGroup | None) -> None:
    """Shut down each EP group given (None: none); the caller drops its references."""
    for ep in groups:
        if ep is not None:
            try:
                ep.group.shutdown()
            except RuntimeError:
                logger.debug("shutting down an EP group raised", exc_info=True)
