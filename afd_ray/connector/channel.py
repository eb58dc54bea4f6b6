"""The A2F/F2A connector: step headers on a control plane, tensors on a data plane.

Control plane: every FFN rank binds one ZeroMQ PULL socket; each attention peer
connects a PUSH socket to it and sends `StepHeader`s (JOIN, STEP, LEAVE). The FFN waits
on it with a poll timeout, so an idle FFN rank never blocks in a collective and
`close()` releases it at once.

Data plane: each attention↔FFN pair owns a 2-rank stateless process group (FFN rank 0,
attention rank 1) from `new_process_group`, rendezvoused through the FFN rank's
`TCPStore`. It carries only `[T, H]` tensors, in the order fixed by the header: for
each FFN layer, A2F then F2A.

Protocol rules (why it cannot deadlock with one FFN peer per attention rank):
1. An attention rank sends JOIN, then opens its pair group; the FFN opens its side when
   it reads the JOIN, at a step boundary. Headers from one peer are read in order.
2. An attention rank sends STEP(T) before the tensors of a step and waits for the F2A of
   the last layer before its next header, so at most one step per peer is in flight.
   Per FFN layer it sends `[T, H]`, then (with `gate_on_attention`) top-k ids and
   weights `[T, k]`, then receives `[T, H]`.
3. The FFN posts data-plane receives only for peers whose STEP it has read, so every
   posted receive has a sender on the way; each one is bounded by `timeout_s`, and a
   dead peer fails it at once ("connection closed by peer").
4. Every pair has the epoch of its assignment: the JOIN carries it, and later STEP and
   LEAVE headers of that peer must carry the same one. A header from an older epoch
   (a stale JOIN, or a STEP/LEAVE of a pairing the peer has since replaced) is
   dropped, never applied; so is one from a peer that has not joined.

Release on `close()`: the FFN waits for headers with a poll timeout, so stopping the
loop releases it within one poll. A data-plane receive already posted cannot be
cancelled from the same process (gloo's `abort()`/`shutdown()` do not wake it, and a
gloo wait that times out closes the pair); it ends when its data arrives, when the
peer closes or dies (gloo reports "connection closed by peer" at once), or after
`timeout_s`. Rule 3 keeps every posted receive short.

CUDA (`nccl`): every data-plane call returns at once on the host; it is queued on the
pair group's NCCL stream after the work already queued on the caller's current CUDA
stream, and `Work.wait()` makes the caller's current stream wait for it (no host wait).
The `isend_*`/`irecv_*` variants return that `Work` so that a caller can overlap it with
compute, and can be captured in a CUDA graph (after one eager call has created the NCCL
communicator); headers stay on the ZeroMQ socket, outside any graph. A pair may open
`ubatch_groups` > 1 process groups, one per micro-batch (`afd_ray.connector.ubatch`):
each has its own NCCL stream, so the transfers of one ubatch never queue behind those
of the other. The ops of one group run in order on one stream, so a receive queued
before a send of the same group deadlocks on NCCL: send A2F first, then receive F2A.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import zmq

from afd_ray.connector.header import HeaderKind, StepHeader
from afd_ray.connector.process_group import new_process_group

__all__ = ["AttentionChannel", "FFNAddress", "FFNChannel"]

logger = logging.getLogger(__name__)

_LEAVE_LINGER_MS = 1000
"""How long closing an attention channel waits for its LEAVE to leave the socket."""
_A2F_TAG = 1
_F2A_TAG = 2
_TOPK_IDS_TAG = 3
_TOPK_WEIGHTS_TAG = 4


@dataclass(frozen=True)
class FFNAddress:
    """Where attention peers reach one FFN rank (published through the coordinator)."""

    host: str
    store_port: int
    """Port of the FFN rank's `TCPStore` (pair-group rendezvous)."""
    control_port: int
    """Port of the FFN rank's header socket."""


def _pair_prefix(peer: int, epoch: int) -> str:
    return f"afd/pair/{peer}/{epoch}"


def _ubatch_groups(
    backend: str, store: dist.Store, prefix: str, rank: int, timeout_s: float, count: int
) -> list[dist.ProcessGroup]:
    """The pair groups of micro-batches 1..count-1 (group 0 is the pair group itself)."""
    if count < 1:
        raise ValueError(f"ubatch_groups must be >= 1, got {count}")
    return [
        new_process_group(backend, dist.PrefixStore(f"{prefix}/ubatch{u}", store), rank, 2, timeout_s)
        for u in range(1, count)
    ]


class AttentionChannel:
    """Attention side of one attention↔FFN pair.

    Args:
        address: the FFN peer.
        peer: this attention rank's id.
        epoch: membership epoch of the assignment.
        backend: `gloo` | `nccl` | `hccl`.
        timeout_s: bound on rendezvous and on every receive, seconds.
        ubatch_groups: pair process groups, one per micro-batch (DBO); the FFN side
            must open as many.

    Raises:
        RuntimeError / DistStoreError: the FFN did not open the pair within `timeout_s`.
        ValueError: `ubatch_groups` < 1.
    """

    def __init__(
        self,
        address: FFNAddress,
        peer: int,
        epoch: int,
        backend: str,
        timeout_s: float,
        ubatch_groups: int = 1,
    ) -> None:
        self.peer = peer
        self.epoch = epoch
        self._step_id = 0
        self._zmq = zmq.Context()
        self._push = self._zmq.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(f"tcp://{address.host}:{address.control_port}")
        self._push.send(StepHeader(HeaderKind.JOIN, peer, epoch).pack())
        store = dist.TCPStore(
            address.host, address.store_port, is_master=False,
            timeout=timedelta(seconds=timeout_s),
        )
        self._pg = new_process_group(
            backend, dist.PrefixStore(_pair_prefix(peer, epoch), store), 1, 2, timeout_s
        )
        self._store = store
        self._backend = backend
        self._ubatch_pgs = [self._pg] + _ubatch_groups(
            backend, store, _pair_prefix(peer, epoch), 1, timeout_s, ubatch_groups
        )

    def send_header(self, num_tokens: int) -> StepHeader:
        """Announce a step of `num_tokens` rows; call before its first `send_a2f`."""
        self._step_id += 1
        header = StepHeader(HeaderKind.STEP, self.peer, self.epoch, self._step_id, num_tokens)
        self._push.send(header.pack())
        return header

    def send_a2f(self, hidden: torch.Tensor) -> None:
        """Send `hidden` `[T, H]` (model dtype, contiguous) to the FFN peer."""
        self._pg.send([hidden], 0, _A2F_TAG).wait()

    def recv_f2a(self, out: torch.Tensor) -> torch.Tensor:
        """Receive the FFN output `[T, H]` into `out` and return it."""
        self._pg.recv([out], 0, _F2A_TAG).wait()
        return out

    def isend_a2f(self, hidden: torch.Tensor, ubatch: int = 0) -> dist.Work:
        """Queue `hidden` `[T, H]` (model dtype, contiguous) to the FFN peer on the pair
        group of micro-batch `ubatch`; `hidden` must stay unchanged until the `Work`
        is waited on."""
        return self._ubatch_pgs[ubatch].send([hidden], 0, _A2F_TAG)

    def irecv_f2a(self, out: torch.Tensor, ubatch: int = 0) -> dist.Work:
        """Queue the receive of the FFN output `[T, H]` of micro-batch `ubatch` into
        `out` (a preallocated buffer, e.g. from `afd_ray.connector.buffers`)."""
        return self._ubatch_pgs[ubatch].recv([out], 0, _F2A_TAG)

    def exchange(
        self,
        hidden: torch.Tensor,
        topk: tuple[torch.Tensor, torch.Tensor] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A2F then F2A for one layer: returns the FFN output, shape and dtype of `hidden`.

        Args:
            hidden: `[T, H]` model dtype.
            topk: with `gate_on_attention`, the routing of `hidden`: ids `[T, k]`
                int64 and weights `[T, k]` float32, sent after it.
            out: preallocated `[T, H]` receive buffer; None allocates one.

        With gloo the F2A receive is posted before the A2F sends, so the FFN never
        waits on us; with NCCL it is queued after them (same stream, see above).
        """
        out = torch.empty_like(hidden) if out is None else out
        if self._backend != "gloo":
            self._pg.send([hidden.contiguous()], 0, _A2F_TAG).wait()
            if topk is not None:
                for tensor, tag in zip(topk, (_TOPK_IDS_TAG, _TOPK_WEIGHTS_TAG), strict=True):
                    self._pg.send([tensor.contiguous()], 0, tag).wait()
            self._pg.recv([out], 0, _F2A_TAG).wait()
            return out
        recv = self._pg.recv([out], 0, _F2A_TAG)
        self._pg.send([hidden.contiguous()], 0, _A2F_TAG).wait()
        if topk is not None:
            ids, weights = topk
            self._pg.send([ids.contiguous()], 0, _TOPK_IDS_TAG).wait()
            self._pg.send([weights.contiguous()], 0, _TOPK_WEIGHTS_TAG).wait()
        recv.wait()
        return out

    def close(self) -> None:
        """Tell the FFN peer we leave, then release sockets and the pair group."""
        try:
            self._push.send(StepHeader(HeaderKind.LEAVE, self.peer, self.epoch).pack(), zmq.NOBLOCK)
        except zmq.ZMQError:
            logger.warning("attention rank %d: LEAVE not sent, FFN peer unreachable", self.peer)
        self._push.close(linger=_LEAVE_LINGER_MS)
        self._zmq.term()
        for pg in self._ubatch_pgs:
            pg.shutdown()


class FFNChannel:
    """FFN side: the header socket, the rendezvous store, one pair group per peer.

    Args:
        host: loopback or node IP to bind on; ports come from the OS.
        backend: `gloo` | `nccl` | `hccl`.
        timeout_s: bound on pair rendezvous and on every data-plane receive, seconds.
        epoch: membership epoch this rank serves.
        ubatch_groups: pair process groups per peer, one per micro-batch (DBO); each
            attention peer must open as many.

    Raises:
        ValueError: `ubatch_groups` < 1.
    """

    def __init__(
        self, host: str, backend: str, timeout_s: float, epoch: int = 0, ubatch_groups: int = 1
    ) -> None:
        if ubatch_groups < 1:
            raise ValueError(f"ubatch_groups must be >= 1, got {ubatch_groups}")
        self.epoch = epoch
        self._ubatch_groups = ubatch_groups
        self._ubatch_pairs: dict[int, list[dist.ProcessGroup]] = {}
        self._backend = backend
        self._timeout_s = timeout_s
        self._store = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
        )
        self._zmq = zmq.Context()
        self._pull = self._zmq.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        control_port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.address = FFNAddress(host, self._store.port, control_port)
        self._pairs: dict[int, dist.ProcessGroup] = {}
        self._peer_epochs: dict[int, int] = {}
        """Epoch of each peer's latest JOIN read (rule 4)."""

    @property
    def peers(self) -> list[int]:
        """Attention ranks with an open pair, in admission order."""
        return list(self._pairs)

    def recv_header(self, timeout_s: float) -> StepHeader | None:
        """Next valid header, or None if none arrived within `timeout_s`.

        A header from an older epoch than its peer's pairing (rule 4) is dropped with
        a warning, and None returned.
        """
        if not self._pull.poll(timeout_s * 1000):
            return None
        header = StepHeader.unpack(self._pull.recv())
        joined = self._peer_epochs.get(header.peer)
        if header.kind is HeaderKind.JOIN and (joined is None or header.epoch >= joined):
            self._peer_epochs[header.peer] = header.epoch
            return header
        if header.kind is not HeaderKind.JOIN and header.epoch == joined:
            return header
        logger.warning("dropped %s: peer %d is paired under epoch %s", header, header.peer, joined)
        return None

    def admit(self, peer: int) -> None:
        """Open the pair group with attention rank `peer` under the epoch of its JOIN
        (blocks until it joins).

        Raises:
            RuntimeError / DistStoreError: the peer did not rendezvous within the timeout.
        """
        self.remove(peer)  # a re-JOIN replaces the peer's older pairing
        epoch = self._peer_epochs[peer]
        prefix = dist.PrefixStore(_pair_prefix(peer, epoch), self._store)
        self._pairs[peer] = new_process_group(self._backend, prefix, 0, 2, self._timeout_s)
        self._ubatch_pairs[peer] = _ubatch_groups(
            self._backend, self._store, _pair_prefix(peer, epoch), 0, self._timeout_s, self._ubatch_groups
        )

    def remove(self, peer: int) -> None:
        """Close the pair group of `peer` (after its LEAVE, or on its failure)."""
        pair = self._pairs.pop(peer, None)
        if pair is not None:
            pair.shutdown()
        for group in self._ubatch_pairs.pop(peer, []):
            group.shutdown()

    def recv_a2f(self, peer: int, out: torch.Tensor) -> torch.Tensor:
        """Receive `[T, H]` from `peer` into `out` and return it."""
        self._pairs[peer].recv([out], 1, _A2F_TAG).wait()
        return out

    def _group(self, peer: int, ubatch: int) -> dist.ProcessGroup:
        return self._pairs[peer] if ubatch == 0 else self._ubatch_pairs[peer][ubatch - 1]

    def irecv_a2f(self, peer: int, out: torch.Tensor, ubatch: int = 0) -> dist.Work:
        """Queue the receive of micro-batch `ubatch`'s `[T, H]` from `peer` into `out`
        (a preallocated buffer); wait on the `Work` before reading `out`."""
        return self._group(peer, ubatch).recv([out], 1, _A2F_TAG)

    def isend_f2a(self, peer: int, out: torch.Tensor, ubatch: int = 0) -> dist.Work:
        """Queue the FFN output `[T, H]` (contiguous) of micro-batch `ubatch` back to
        `peer`; `out` must stay unchanged until the `Work` is waited on."""
        return self._group(peer, ubatch).send([out], 1, _F2A_TAG)

    def recv_topk(self, peer: int, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """With `gate_on_attention`: receive the routing of the rows of the last
        `recv_a2f` from `peer`, ids `[T, k]` int64 and weights `[T, k]` float32."""
        self._pairs[peer].recv([ids], 1, _TOPK_IDS_TAG).wait()
        self._pairs[peer].recv([weights], 1, _TOPK_WEIGHTS_TAG).wait()

    def send_f2a(self, peer: int, out: torch.Tensor) -> None:
        """Send the FFN output `[T, H]` back to `peer`."""
        self._pairs[peer].send([out.contiguous()], 1, _F2A_TAG).wait()

    def close(self) -> None:
        """Close every pair group and the header socket."""
        for peer in self.peers:
            self.remove(peer)
        self._pull.close()
        self._zmq.term()
