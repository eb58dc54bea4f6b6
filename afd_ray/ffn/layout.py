"""The FFN layout one rank serves, and every change to it at a step boundary.

A layout is the FFN model (this rank's expert shard), its EP group and its epoch.
Changes, all applied by the loop's thread between two steps (`Layout.boundary`):

- JOIN/LEAVE headers read while forming a step: their peers are admitted or removed;
  a peer that cannot be admitted (it died before the rendezvous, or announced a
  transport this rank cannot serve) is logged and skipped.
- Attention peers lost inside the step (their rows were zeroed and the step ran to
  its end for the others) and peers the coordinator reported dead (`drop_peers`):
  their pairs are closed, so steps stop waiting for them.
- A new layout (a resize of the FFN pool, make before break): prepared outside the
  loop (new expert shard loaded, new EP group opened) and handed over with
  `prepare_switch`; the loop switches model, EP group and epoch together at the first
  boundary at which every rank of its current EP group has its switch prepared
  (agreed in `EPGroup.agree`).

The longest such pause is kept for `take_pause`.

EP loss (docs/failures.md): a failed EP collective (an EP rank died, or the group
timed out) closes every attention pair, so the attention ranks fail at once and wait
for their re-peering, and the loop serves nothing until the coordinator's re-formed
layout is handed over (`prepare_switch`), which it switches to at once
(`await_layout`); past `ep_lost_wait_s` the loop ends (the coordinator then replaces
this rank too).

Compute runs through `FFNGraphs`, built at the first step of each layout (with EP
every rank of the group is in that step): on CUDA (`graphs.graphs_supported`) it
captures every layer as a CUDA graph per bucket of padded rows, and steps larger than
every bucket run eagerly; on CPU every step runs eagerly on exactly its rows.

Streams (CUDA): tensors made by other threads (a prepared layout) are made on the
legacy default stream; at a switch the loop's stream waits for it, and makes it wait
for the old layout's last step before dropping that layout (so that its freed memory
is reused only after that step).

Closing: a gloo group closes its connections (the other ranks' collectives fail with
"connection closed") only once it is destroyed; `shutdown()` alone leaves them
waiting out the timeout. So when the loop ends, `close` shuts down the serving group
and a prepared one and drops every reference to them, and a layout handed over after
that is shut down at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from afd_ray.connector.header import HeaderKind, StepHeader
from afd_ray.connector.link import FFNLink, PeerLostError
from afd_ray.ffn.ep import EPGroup
from afd_ray.ffn.graphs import FFNGraphs, graphs_supported
from afd_ray.ffn.model import FFNStack

__all__ = ["Layout", "LayoutSwitch"]

logger = logging.getLogger(__name__)

_LAYOUT_POLL_S = 0.05
"""While the EP group is lost: how often the loop checks for the next layout, seconds."""


@dataclass(frozen=True)
class LayoutSwitch:
    """A prepared FFN layout for `Layout.prepare_switch`."""

    epoch: int
    """Layout epoch served after the switch."""
    model: FFNStack
    """The FFN blocks of the new layout (this rank's new expert shard)."""
    ep: EPGroup | None
    """The new layout's EP group, or None for a single FFN rank (or a dense model)."""
    leave: bool = False
    """This rank leaves the layout: it serves no step after the switch."""


class Layout:
    """The layout one FFN rank serves and its changes at step boundaries (module docstring).

    `prepare_switch`, `drop_peers`, `take_pause` and the attributes may be used from
    any thread; everything else from the loop's thread only.

    Args:
        model: the FFN blocks of every layer, on their device, in the model dtype.
        ep: the EP group among FFN ranks, or None for a single FFN rank.
        epoch: the layout epoch this rank starts in.
        channel: the FFN side of the connector (its peers are admitted and removed here).
        dtype: dtype of the A2F/F2A tensors (the model dtype).
        graph_buckets: padded token counts per FFN rank captured as CUDA graphs.
        ubatches: the loop's ubatches per step (only for a warning: with EP a step runs
            as one).
        ep_lost_wait_s: how long the loop waits for the re-formed layout after its EP
            group failed, seconds.
        stream: the loop's CUDA stream, or None on CPU.
        rest: called at every switch and EP loss: the next step starts no timed
            interval (`StepMeter.rest`).
    """

    def __init__(
        self,
        model: FFNStack,
        ep: EPGroup | None,
        epoch: int,
        channel: FFNLink,
        dtype: torch.dtype,
        graph_buckets: Sequence[int],
        ubatches: int,
        ep_lost_wait_s: float,
        stream: torch.cuda.Stream | None,
        rest: Callable[[], None],
    ) -> None:
        self.model = model
        self.ep = ep
        self.epoch = epoch
        """Layout epoch this rank serves."""
        self.left = False
        """This rank left the layout (it serves no step any more)."""
        self._channel = channel
        self._dtype = dtype
        self._graph_buckets = tuple(graph_buckets)
        self._ubatches = ubatches
        self._ep_lost_wait_s = ep_lost_wait_s
        self._stream = stream
        self._rest = rest
        self._compute: FFNGraphs | None = None
        self._pending: LayoutSwitch | None = None
        self._closed = False
        """The loop ended and closed its groups: a layout handed over later is closed at once."""
        self._lock = threading.Lock()
        """Orders `prepare_switch` against `close`."""
        self._dead: frozenset[int] = frozenset()
        self._pause_s = 0.0
        self._lost_at: float | None = None
        """When the EP group failed (`time.monotonic()`); None while it serves."""

    @property
    def prepared(self) -> LayoutSwitch | None:
        """The layout handed over and not switched to yet, if any."""
        return self._pending

    @property
    def ep_lost(self) -> bool:
        """Its EP group failed and the re-formed layout has not been handed over yet:
        the loop serves nothing meanwhile."""
        return self._lost_at is not None

    def prepare_switch(self, switch: LayoutSwitch) -> None:
        """Hand over a prepared layout; the loop switches to it at the first step
        boundary where every rank of the current EP group has one (thread-safe).
        Once the loop has ended, its EP group is shut down at once instead (and no
        reference kept), so the other ranks of that layout fail over rather than
        wait out its timeout for this rank."""
        with self._lock:
            if not self._closed:
                self._pending = switch
                return
        logger.warning("FFN layout of epoch %d handed over after the loop ended: its EP group is closed", switch.epoch)
        _shutdown(switch.ep)

    def drop_peers(self, peers: list[int]) -> None:
        """Attention peers that died without LEAVE: their pairs are removed at the next
        step boundary, so steps stop waiting for them (thread-safe)."""
        self._dead = frozenset(peers)

    def take_pause(self) -> float:
        """Longest step-boundary pause (admitting or removing peers, switching the
        layout) since the previous call, seconds."""
        pause, self._pause_s = self._pause_s, 0.0
        return pause

    def compute(self) -> FFNGraphs:
        """The compute of the current model and EP group, built (graphs captured) at
        the first step that uses them."""
        compute = self._compute
        if compute is None or compute.model is not self.model or compute.ep is not self.ep:
            if self._ubatches > 1 and self.ep is not None:
                logger.warning(
                    "ffn.ubatches %d has no effect in this layout: with EP (%d FFN ranks) a step runs as one ubatch",
                    self._ubatches,
                    self.ep.size,
                )
            buckets = self._graph_buckets if graphs_supported(self.model, self._dtype) else ()
            compute = self._compute = FFNGraphs(self.model, self.ep, self._dtype, buckets)
        return compute

    def boundary(self, membership: Sequence[StepHeader], lost: set[int], switch: LayoutSwitch | None) -> bool:
        """Apply the changes due after a step: admit/remove `membership`'s peers, close
        the pairs of `lost` peers and of the ones `drop_peers` named, then switch to
        `switch` (None: no switch). Returns whether anything changed."""
        start = time.perf_counter()
        for header in membership:
            self._apply(header)
        dead = self._dead.intersection(self._channel.peers) | lost
        for peer in dead:
            self._channel.remove(peer)
            logger.warning("FFN dropped attention rank %d: it vanished without LEAVE", peer)
        if switch is not None:
            self._switch(switch)
        changed = bool(membership or switch or dead)
        if changed:
            self._pause_s = max(self._pause_s, time.perf_counter() - start)
        return changed

    def lose_ep(self, exc: RuntimeError) -> None:
        """The EP group failed: close every attention pair and the group; the rank
        serves nothing until a new layout is handed over (`await_layout`)."""
        assert self.ep is not None
        logger.warning("FFN EP group of epoch %d failed (%s); waiting for the re-formed layout", self.epoch, exc)
        for peer in self._channel.peers:
            self._channel.remove(peer)
        self._compute = None
        self._rest()
        group, self.ep = self.ep.group, None
        try:
            group.shutdown()
        except RuntimeError:
            logger.debug("shutting down the failed EP group raised", exc_info=True)
        self._lost_at = time.monotonic()

    def await_layout(self, stop: threading.Event) -> bool:
        """While the EP group is lost: switch to the next layout once it is handed over
        (True: serve again), else wait one poll or until `stop` is set (False).

        Raises:
            RuntimeError: none came within `ep_lost_wait_s` of the loss.
        """
        assert self._lost_at is not None
        pending = self._pending
        if pending is not None:
            self._switch(pending)
            self._pause_s = max(self._pause_s, time.monotonic() - self._lost_at)
            self._lost_at = None
            return True
        if time.monotonic() - self._lost_at > self._ep_lost_wait_s:
            raise RuntimeError(f"FFN EP group lost and no new layout within {self._ep_lost_wait_s} s")
        stop.wait(_LAYOUT_POLL_S)
        return False

    def close(self) -> None:
        """Shut down the serving EP group and a prepared one, if any, and drop every
        reference to them (the loop ended; module docstring)."""
        with self._lock:
            pending, self._pending, self._closed = self._pending, None, True
        _shutdown(self.ep, pending.ep if pending is not None else None)
        self.ep, self._compute = None, None  # FFNGraphs holds the serving group too

    def _switch(self, switch: LayoutSwitch) -> None:
        """Serve the layout of `switch` from the next step on; the old EP group is
        destroyed here, its tensors are freed with the old model."""
        old = self.ep
        if self._stream is not None:  # the old layout's memory is reused after its last step; the new one is made
            device = self._stream.device
            torch.cuda.default_stream(device).wait_stream(self._stream)
            self._stream.wait_stream(torch.cuda.default_stream(device))
        self.model, self.ep, self.epoch, self.left = switch.model, switch.ep, switch.epoch, switch.leave
        self._channel.epoch = switch.epoch
        self._pending = None
        self._rest()
        self._compute = None  # its CUDA graphs captured the old EP group: free them before its shutdown
        if old is not None and old is not switch.ep:
            old.group.shutdown()
        served = "left" if switch.leave else f"EP {switch.ep.rank}/{switch.ep.size}" if switch.ep else "no EP"
        logger.info("FFN switched to the layout of epoch %d (%s)", switch.epoch, served)

    def _apply(self, header: StepHeader) -> None:
        """Admit a JOIN's peer, or remove a LEAVE's (module docstring)."""
        if header.kind is HeaderKind.JOIN:
            try:
                self._channel.admit(header.peer)
            except (PeerLostError, ValueError) as exc:
                logger.warning("FFN did not admit attention rank %d (epoch %d): %s", header.peer, header.epoch, exc)
                return
            logger.info("FFN admitted attention rank %d (epoch %d)", header.peer, header.epoch)
        else:
            self._channel.remove(header.peer)
            logger.info("attention rank %d left (epoch %d)", header.peer, header.epoch)


def _shutdown(*groups: EPGroup | None) -> None:
    """Shut down each EP group given (None: none); the caller drops its references."""
    for ep in groups:
        if ep is not None:
            try:
                ep.group.shutdown()
            except RuntimeError:
                logger.debug("shutting down an EP group raised", exc_info=True)
