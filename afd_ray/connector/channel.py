"""The A2F/F2A connector: step headers on a control plane, tensors on a data plane.

`AttentionChannel` and `FFNChannel` implement the contract of
`afd_ray.connector.link` (`AttentionLink`, `FFNLink`) for every transport: the
control plane below is shared, the data plane of each pair is the transport the
attention side announces (`shm`, `gloo`, `nccl`, `hccl`).

Control plane: every FFN rank binds one ZeroMQ PULL socket; each attention peer
connects a PUSH socket to it and sends `StepHeader`s (JOIN, STEP, LEAVE). The FFN waits
on it with a poll timeout, so an idle FFN rank never blocks in a collective and
`close()` releases it at once.

Data plane: each attention↔FFN pair rendezvouses through the FFN rank's `TCPStore`
under the prefix `afd/pair/<peer>/<epoch>`, where the attention side first writes its
transport, and opens a `Pair` (`afd_ray.connector.pair`) of it: `shm` (same host):
shared-memory slots and a Unix-socket wake-up (`afd_ray.connector.shm`);
`gloo`/`nccl`/`hccl`: 2-rank stateless process groups (`afd_ray.connector.group_pair`);
`cuda_ipc` (GPUs of one node): `afd_ray.connector.cuda_ipc`. It carries only tensors,
in the order fixed by the header: for each FFN layer, A2F then F2A.

Protocol rules (why it cannot deadlock with one FFN peer per attention rank):
1. An attention rank writes its transport to the store, sends JOIN, then opens its
   data plane; the FFN opens its side when it reads the JOIN, at a step boundary.
   Headers from one peer are read in order.
2. An attention rank sends STEP(T) before the tensors of a step and waits for the F2A of
   the last layer before the tensors of its next step, so at most one step per peer is
   in flight on the data plane. On CUDA that wait is on the device, so the host may
   send the next STEP header before the FFN has run the current step: the FFN serves
   a peer's headers in order, one per FFN step (`afd_ray.ffn.runtime.FFNRuntime`).
   Per FFN layer it sends `[T, H]`, then (with `gate_on_attention`) top-k ids and
   weights `[T, k]`, then receives `[T, H]`.
3. The FFN posts data-plane receives only for peers whose STEP it has read, so every
   posted receive has a sender on the way; each one is bounded by `timeout_s`, and a
   dead peer fails it at once (`PeerLostError`: gloo's "connection closed by peer",
   or the shm socket's end of file).
4. Every pair has the epoch of its assignment: the JOIN carries it, and later STEP and
   LEAVE headers of that peer must carry the same one. A header from an older epoch
   (a stale JOIN, or a STEP/LEAVE of a pairing the peer has since replaced) is
   dropped, never applied; so is one from a peer that has not joined.

Release on `close()`: the FFN waits for headers with a poll timeout, so stopping the
loop releases it within one poll. Data-plane waits end at once on `close()`: `shm`
shuts its socket down; gloo times out a receive nobody answers, which makes gloo
close the pair's TCP connection and fail every wait on it (`GroupPair.close`), and
the peer sees the connection closed at once. Either way the error is
`PeerLostError` "pair closed", and nothing is written into a receive's buffer after
`close()` returned. NCCL/HCCL waits end when their peer closes or at `timeout_s`.

CUDA (`nccl`, `cuda_ipc`): every data-plane call returns at once on the host, queued
after the work on the caller's current CUDA stream (`afd_ray.connector.group_pair`).
The `isend_*`/`irecv_*` variants return it as a `Pending` so that a caller can overlap
it with compute, and can be captured in a CUDA graph (after one eager call has created
the NCCL communicator); headers stay on the ZeroMQ socket, outside any graph. A pair
may open `ubatch_groups` > 1 data planes, one per micro-batch (DBO;
`tests/connector/test_ubatch.py` runs a two-ubatch schedule over them): with NCCL each
has its own stream, so the transfers of one ubatch never queue behind the other's.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist
import zmq

from afd_ray.connector.cuda_ipc import open_cuda_ipc_pair
from afd_ray.connector.group_pair import open_group_pair
from afd_ray.connector.header import FFNAddress, HeaderKind, StepHeader
from afd_ray.connector.link import PeerLostError
from afd_ray.connector.pair import Pair, Pending, Side
from afd_ray.connector.shm import open_shm_pair
from afd_ray.connector.transports import Transport, check_transport
from afd_ray.platform import Backend

__all__ = ["AttentionChannel", "FFNChannel"]

logger = logging.getLogger(__name__)

_LEAVE_LINGER_MS = 1000
"""How long closing an attention channel waits for its LEAVE to leave the socket."""
_TRANSPORT_KEY = "transport"
"""Pair-store key under which the attention side announces its transport."""


def _pair_store(store: dist.Store, peer: int, epoch: int) -> dist.Store:
    return dist.PrefixStore(f"afd/pair/{peer}/{epoch}", store)


def _open_pair(transport: str, store: dist.Store, side: Side, peer: int, timeout_s: float, ubatches: int) -> Pair:
    """One side of a pair's data plane; blocks until the other side opened its own.

    Raises:
        PeerLostError: the rendezvous failed or timed out.
        ValueError: unknown or unimplemented transport, or `ubatches` < 1.
    """
    if ubatches < 1:
        raise ValueError(f"ubatch_groups must be >= 1, got {ubatches}")
    if transport == "shm":
        return open_shm_pair(side, store, peer, ubatches, timeout_s)
    if transport == "cuda_ipc":
        try:
            return open_cuda_ipc_pair(side, store, peer, ubatches, timeout_s)
        except RuntimeError as exc:  # DistStoreError included
            raise PeerLostError(peer, f"cuda_ipc rendezvous failed ({exc})") from exc
    if transport not in ("gloo", "nccl", "hccl"):
        raise ValueError(f"connector.transport: {transport!r} is not implemented")
    return open_group_pair(side, store, peer, ubatches, timeout_s, transport)


class AttentionChannel:
    """Attention side of one attention↔FFN pair (implements `AttentionLink`).

    Args:
        address: the FFN peer.
        peer: this attention rank's id.
        epoch: membership epoch of the assignment.
        transport: the pair's data plane: `shm` | `gloo` | `nccl` | `hccl` | `cuda_ipc`.
        timeout_s: bound on rendezvous and on every receive, seconds.
        ubatch_groups: data planes per pair, one per micro-batch (DBO); the FFN side
            must open as many.

    Raises:
        PeerLostError: the FFN did not open the pair within `timeout_s`.
        RuntimeError / DistStoreError: the FFN's store is unreachable.
        ValueError: `ubatch_groups` < 1, or an unknown transport.
    """

    def __init__(
        self,
        address: FFNAddress,
        peer: int,
        epoch: int,
        transport: Transport,
        timeout_s: float,
        ubatch_groups: int = 1,
    ) -> None:
        if ubatch_groups < 1:
            raise ValueError(f"ubatch_groups must be >= 1, got {ubatch_groups}")
        self.peer = peer
        self.epoch = epoch
        self.transport = transport
        self._step_id = 0
        self._store = dist.TCPStore(
            address.host,
            address.store_port,
            is_master=False,
            timeout=timedelta(seconds=timeout_s),
        )
        self._zmq = zmq.Context()
        self._push = self._zmq.socket(zmq.PUSH)
        try:
            pair = _pair_store(self._store, peer, epoch)
            pair.set(_TRANSPORT_KEY, transport)
            self._push.setsockopt(zmq.LINGER, 0)
            self._push.connect(f"tcp://{address.host}:{address.control_port}")
            self._push.send(StepHeader(HeaderKind.JOIN, peer, epoch).pack())
            self._data = _open_pair(transport, pair, "attention", peer, timeout_s, ubatch_groups)
        except BaseException:  # the pair never opened: release what was opened for it
            self._push.close(linger=0)
            self._zmq.term()
            del self._store  # its connection closes with the last reference (the raised error's frames)
            raise
        self._closed = False

    def send_header(self, num_tokens: int, first_layer: int = 0) -> StepHeader:
        """Announce a step of `num_tokens` rows whose FFN layers from `first_layer` on
        follow; call before its first A2F."""
        self._step_id += 1
        header = StepHeader(HeaderKind.STEP, self.peer, self.epoch, self._step_id, num_tokens, first_layer)
        self._push.send(header.pack())
        return header

    def isend_a2f(
        self, hidden: torch.Tensor, ubatch: int = 0, topk: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> Pending:
        """Queue `hidden` `[T_u, H]` (model dtype, contiguous), with `gate_on_attention`
        its top-k ids and weights `[T_u, k]`, to the FFN peer on ubatch `ubatch`; the
        tensors must stay unchanged until the `Pending` is waited on."""
        return self._data.send([hidden, *(topk or ())], ubatch)

    def irecv_f2a(self, out: torch.Tensor, ubatch: int = 0) -> Pending:
        """Queue the receive of the FFN output `[T_u, H]` of ubatch `ubatch` into `out`
        (contiguous, preallocated by the caller)."""
        return self._data.recv([out], ubatch)

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

        Raises:
            PeerLostError: the FFN peer is gone.
        """
        out = torch.empty_like(hidden) if out is None else out
        sends = [hidden.contiguous()] + ([t.contiguous() for t in topk] if topk is not None else [])
        self._data.exchange(sends, [out], 0)
        return out

    def close(self) -> None:
        """Tell the FFN peer we leave, then release sockets and the data plane."""
        if self._closed:
            return
        self._closed = True
        try:
            self._push.send(StepHeader(HeaderKind.LEAVE, self.peer, self.epoch).pack(), zmq.NOBLOCK)
        except zmq.ZMQError:
            logger.warning("attention rank %d: LEAVE not sent, FFN peer unreachable", self.peer)
        self._push.close(linger=_LEAVE_LINGER_MS)
        self._zmq.term()
        self._data.close()


class FFNChannel:
    """FFN side: the header socket, the rendezvous store, one data plane per peer
    (implements `FFNLink`).

    Args:
        host: loopback or node IP to bind on; ports come from the OS.
        backend: the platform's collective backend (`gloo` | `nccl` | `hccl`); a peer
            may announce it or its same-host transport (`shm` for gloo).
        timeout_s: bound on pair rendezvous and on every data-plane receive, seconds.
        epoch: membership epoch this rank serves.
        ubatch_groups: data planes per peer, one per micro-batch (DBO); each
            attention peer must open as many.
        node: this rank's Ray node id, published in `address`.

    Raises:
        ValueError: `ubatch_groups` < 1.
    """

    def __init__(
        self,
        host: str,
        backend: Backend,
        timeout_s: float,
        epoch: int = 0,
        ubatch_groups: int = 1,
        node: str = "",
    ) -> None:
        if ubatch_groups < 1:
            raise ValueError(f"ubatch_groups must be >= 1, got {ubatch_groups}")
        self.epoch = epoch
        self._ubatch_groups = ubatch_groups
        self._backend = backend
        self._timeout_s = timeout_s
        self._store = dist.TCPStore(
            host,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
        )
        self._zmq = zmq.Context()
        self._pull = self._zmq.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        control_port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.address = FFNAddress(host, self._store.port, control_port, node)
        self._pairs: dict[int, Pair] = {}
        self._transports: dict[int, Transport] = {}
        self._peer_epochs: dict[int, int] = {}
        """Epoch of each peer's latest JOIN read (rule 4)."""

    @property
    def peers(self) -> list[int]:
        """Attention ranks with an open pair, in admission order."""
        return list(self._pairs)

    def recv_header(self, timeout_s: float) -> StepHeader | None:
        """Next valid header, or None if none arrived within `timeout_s`.

        A header from an older epoch than its peer's pairing (rule 4), or a STEP of a
        pair that is closed (its peer was lost, or the FFN rank lost its EP group), is
        dropped with a warning, and None returned.
        """
        if not self._pull.poll(timeout_s * 1000):
            return None
        header = StepHeader.unpack(self._pull.recv())
        joined = self._peer_epochs.get(header.peer)
        if header.kind is HeaderKind.JOIN and (joined is None or header.epoch >= joined):
            self._peer_epochs[header.peer] = header.epoch
            return header
        if header.kind is HeaderKind.STEP and header.epoch == joined and header.peer not in self._pairs:
            logger.warning("dropped %s: the pair of peer %d is closed", header, header.peer)
            return None
        if header.kind is not HeaderKind.JOIN and header.epoch == joined:
            return header
        logger.warning("dropped %s: peer %d is paired under epoch %s", header, header.peer, joined)
        return None

    def admit(self, peer: int) -> None:
        """Open the data plane with attention rank `peer` under the epoch of its JOIN,
        with the transport it announced (blocks until it joins). On failure the JOIN
        is forgotten: the peer's later STEP/LEAVE headers are dropped (rule 4) until
        it joins again.

        Raises:
            PeerLostError: the peer did not rendezvous within the timeout.
            ValueError: it announced a transport this rank's backend cannot serve.
        """
        self.remove(peer)  # a re-JOIN replaces the peer's older pairing
        pair = _pair_store(self._store, peer, self._peer_epochs[peer])
        try:
            try:
                transport = pair.get(_TRANSPORT_KEY).decode()
            except RuntimeError as exc:
                raise PeerLostError(peer, f"no transport announced ({exc})") from exc
            check_transport(transport, self._backend)
            self._pairs[peer] = _open_pair(transport, pair, "ffn", peer, self._timeout_s, self._ubatch_groups)
        except (PeerLostError, ValueError):
            del self._peer_epochs[peer]
            raise
        self._transports[peer] = transport  # type: ignore[assignment]

    def transport_of(self, peer: int) -> Transport:
        """The data plane of `peer`'s open pair.

        Raises:
            KeyError: no open pair with `peer`.
        """
        return self._transports[peer]

    def remove(self, peer: int) -> None:
        """Close the pair of `peer` (after its LEAVE, or on its failure)."""
        pair = self._pairs.pop(peer, None)
        self._transports.pop(peer, None)
        if pair is not None:
            pair.close()

    def recv_a2f(
        self,
        peer: int,
        out: torch.Tensor,
        topk: tuple[torch.Tensor, torch.Tensor] | None = None,
        ubatch: int = 0,
    ) -> torch.Tensor:
        """Receive `[T, H]` from `peer` into `out` and return it; with
        `gate_on_attention` also its routing, ids `[T, k]` int64 and weights
        `[T, k]` float32, into `topk`.

        Raises:
            PeerLostError: the peer is gone.
        """
        self._pairs[peer].recv([out, *(topk or ())], ubatch).wait()
        return out

    def irecv_a2f(self, peer: int, out: torch.Tensor, ubatch: int = 0) -> Pending:
        """Queue the receive of micro-batch `ubatch`'s `[T, H]` from `peer` into `out`
        (a preallocated buffer); wait on the `Pending` before reading `out`."""
        return self._pairs[peer].recv([out], ubatch)

    def isend_f2a(self, peer: int, out: torch.Tensor, ubatch: int = 0) -> Pending:
        """Queue the FFN output `[T, H]` (contiguous) of micro-batch `ubatch` back to
        `peer`; `out` must stay unchanged until the `Pending` is waited on."""
        return self._pairs[peer].send([out], ubatch)

    def send_f2a(self, peer: int, out: torch.Tensor, ubatch: int = 0) -> None:
        """Send the FFN output `[T, H]` back to `peer`.

        Raises:
            PeerLostError: the peer is gone.
        """
        self._pairs[peer].send([out.contiguous()], ubatch).wait()

    def close(self) -> None:
        """Close every pair and the header socket."""
        for peer in self.peers:
            self.remove(peer)
        self._pull.close()
        self._zmq.term()
