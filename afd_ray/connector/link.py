"""The connector contract: what each side of an attention↔FFN pair may rely on.

Every transport implements the same two roles, and `FFNClient` (attention side),
`FFNRuntime` (FFN side) and the benchmarks use nothing else:

- `AttentionLink`: one attention rank's link to its FFN peer.
- `FFNLink`: one FFN rank's links to all of its attention peers.

Control plane (transport-independent, `afd_ray.connector.header`): the attention rank
sends JOIN when it opens the pair, one STEP header at the start of every forward pass
(`AttentionLink.send_header`, explicit, never inferred from layer indices), and LEAVE
on `close()`. Every header carries the pair's epoch; the FFN side drops a header of
another epoch than its peer's latest JOIN, and one of a peer that has not joined.

Data plane, per forward pass announced as `STEP(T, first_layer)`, for every FFN layer
`l` from `first_layer` on, per micro-batch `u` (DBO; one ubatch unless the link was
opened with more), strictly in this order on each ubatch:

| direction | tensors | shape | dtype |
|---|---|---|---|
| A2F | hidden states (post-attention norm) | `[T_u, H]` | model dtype |
| A2F, `gate_on_attention` only | top-k ids, top-k weights | `[T_u, k]`, `[T_u, k]` | int64, float32 |
| F2A | FFN output | `[T_u, H]` | model dtype |
| F2A, split MoE layer | routed experts' output (weights unscaled), then shared experts' | `[T_u, P, H]` | model dtype |

Which MoE layers split is fixed for the life of a pair by the checkpoint and the
attention engines' mode, and both sides derive it from them the same way
(`afd_ray.layers.spec.MoEShape.split_output`: torch.compile'd engines, layers with
shared experts or a routed scaling factor; P = 2 with shared experts, else 1); the
attention side finishes the sum (`afd_ray.attention.models.base.combine_moe_parts`).
The receiver's `out` has the shape it expects; transports move bytes and check only
that a message fits.

The attention side sends A2F of layer `l` only after it received F2A of layer `l - 1`
(of the same ubatch), and the FFN side sends F2A only after it received that layer's
A2F, so at most one message per direction and ubatch is in flight. Transports rely
on it: a slot written by the sender is free again once the answer arrived.

Buffer ownership (DeepEP-style):
- A tensor handed to a send belongs to the link until the send's `Pending.wait()`
  returned (blocking calls: until they return); the caller must not change it.
- A receive writes into the caller's `out` (contiguous, exact shape and dtype),
  typically a preallocated per-token-bucket buffer (the FFN side's
  `FFNGraphs.inputs`) that the FFN then computes from; `out` holds the data once the
  receive's `Pending.wait()` returned, and not before.
- All tensors are contiguous and on the link's device (CPU for `shm`/`gloo`).

Errors, the same for every transport:
- `PeerLostError` (a `RuntimeError`): the other side died, closed the pair, or did
  not answer within the link's `timeout_s`. A peer that dies fails the wait at once
  (a closed socket), not after the timeout. The pair is unusable afterwards; the
  caller closes it and, on the attention side, may re-open one to another FFN rank
  and repeat the current layer with `send_header(T, first_layer=layer)`.
- `ValueError`: a tensor not contiguous, or of a shape the header did not announce.
- Every wait is bounded by `timeout_s`, and `close()` from another thread releases a
  wait of the transports that can be woken (`shm`, `gloo`: at once, with
  `PeerLostError` "pair closed"; NCCL/HCCL receives end when their peer closes or at
  `timeout_s`, see `afd_ray.connector.channel`).

Transports (`Transport`), picked per pair by
`afd_ray.connector.transports.select_transport`:
- `shm`: both processes on one host, CPU tensors: shared-memory slots plus a Unix
  socket wake-up (`afd_ray.connector.shm`).
- `gloo`: CPU tensors across hosts (a TCP pair process group).
- `nccl` / `hccl`: CUDA / Ascend tensors across hosts.
- `cuda_ipc`: GPUs of one node, two processes on one GPU included: symmetric-memory
  slots written through CUDA IPC mappings and device-side flags
  (`afd_ray.connector.cuda_ipc`); every call is queued on the current CUDA stream,
  `Pending.wait()` has nothing left to do, and a step can be captured in a CUDA graph.

Each transport implements the data plane of one pair, `afd_ray.connector.pair.Pair`;
`afd_ray.connector.channel` builds both roles over it and the shared control plane.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from afd_ray.connector.header import StepHeader
from afd_ray.connector.pair import Pending
from afd_ray.connector.transports import Transport

__all__ = ["AttentionLink", "FFNLink", "PeerLostError", "contiguous"]


class PeerLostError(RuntimeError):
    """The other side of a pair is gone: it died, closed the pair, or did not answer
    within the link's timeout. The pair is unusable afterwards.

    Attributes:
        peer: the attention rank id of the pair.
    """

    def __init__(self, peer: int, reason: str) -> None:
        super().__init__(f"pair with attention rank {peer}: {reason}")
        self.peer = peer


@runtime_checkable
class AttentionLink(Protocol):
    """An attention rank's side of its pair with one FFN rank (opened by the
    transport's constructor, which sends JOIN and blocks until the FFN admitted it).

    Attributes:
        peer: this attention rank's id.
        epoch: the pair's epoch, carried by every header.
        transport: the pair's data plane.
    """

    peer: int
    epoch: int
    transport: Transport

    def send_header(self, num_tokens: int, first_layer: int = 0) -> StepHeader:
        """Announce a forward pass of `num_tokens` rows (T) whose FFN layers from
        `first_layer` on follow; call before its first A2F.

        Raises:
            PeerLostError: the header socket is closed.
        """

    def exchange(
        self,
        hidden: torch.Tensor,
        topk: tuple[torch.Tensor, torch.Tensor] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A2F then F2A of one layer on ubatch 0, blocking.

        Args:
            hidden: `[T, H]` model dtype.
            topk: with `gate_on_attention`, ids `[T, k]` int64 and weights `[T, k]`
                float32 of `hidden`'s routing.
            out: `[T, H]` receive buffer; None allocates one.

        Returns:
            The FFN output `[T, H]`, `hidden`'s dtype (`out` when given).

        Raises:
            PeerLostError: the FFN peer is gone.
        """

    def isend_a2f(
        self, hidden: torch.Tensor, ubatch: int = 0, topk: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> Pending:
        """Queue the A2F of ubatch `ubatch`: `hidden` `[T_u, H]` (and its top-k ids and
        weights `[T_u, k]`); the tensors belong to the link until `wait()` returned."""

    def irecv_f2a(self, out: torch.Tensor, ubatch: int = 0) -> Pending:
        """Queue the receive of ubatch `ubatch`'s F2A `[T_u, H]` into `out`."""

    def close(self) -> None:
        """Send LEAVE and release the pair; wakes a wait of this link in another
        thread where the transport can (see module docstring). Idempotent."""


@runtime_checkable
class FFNLink(Protocol):
    """An FFN rank's side of its pairs: the header socket and one data plane per
    admitted attention peer.

    Attributes:
        epoch: the FFN layout epoch this rank serves.
        peers: attention ranks with an open pair, in admission order.
    """

    epoch: int

    @property
    def peers(self) -> list[int]: ...

    def recv_header(self, timeout_s: float) -> StepHeader | None:
        """The next valid header, or None when none arrived within `timeout_s`
        seconds or the one that arrived was dropped (wrong epoch)."""

    def admit(self, peer: int) -> None:
        """Open the data plane with `peer` under the epoch of its last JOIN, with the
        transport it announced (replaces an older pair of the same peer). On failure
        the JOIN is forgotten, so the peer's later headers are dropped until it joins
        again; the link keeps serving its other peers.

        Raises:
            PeerLostError: the peer did not rendezvous within the timeout.
            ValueError: it announced a transport this rank's device cannot serve.
        """

    def transport_of(self, peer: int) -> Transport:
        """The data plane of `peer`'s open pair (KeyError if none)."""

    def remove(self, peer: int) -> None:
        """Close the pair of `peer`, if open (after LEAVE, or once it is lost)."""

    def recv_a2f(
        self,
        peer: int,
        out: torch.Tensor,
        topk: tuple[torch.Tensor, torch.Tensor] | None = None,
        ubatch: int = 0,
    ) -> torch.Tensor:
        """Receive `peer`'s A2F `[T, H]` into `out` (and, with `gate_on_attention`,
        its top-k ids `[T, k]` int64 and weights `[T, k]` float32 into `topk`);
        returns `out`.

        Raises:
            PeerLostError: the peer is gone.
        """

    def send_f2a(self, peer: int, out: torch.Tensor, ubatch: int = 0) -> None:
        """Send the FFN output `[T, H]` back to `peer` (blocking)."""

    def irecv_a2f(self, peer: int, out: torch.Tensor, ubatch: int = 0) -> Pending:
        """Queue the receive of ubatch `ubatch`'s A2F `[T_u, H]` into `out`."""

    def isend_f2a(self, peer: int, out: torch.Tensor, ubatch: int = 0) -> Pending:
        """Queue ubatch `ubatch`'s F2A `[T_u, H]` back to `peer`."""

    def close(self) -> None:
        """Close every pair and the header socket."""


def contiguous(tensors: Sequence[torch.Tensor]) -> None:
    """Raise ValueError unless every tensor is contiguous (the contract's rule)."""
    for tensor in tensors:
        if not tensor.is_contiguous():
            raise ValueError(f"connector tensors must be contiguous, got strides {tensor.stride()}")
