"""The data plane of one attention↔FFN pair, as every transport implements it: the
`Pair` protocol, the `Side` a process holds, and the `Pending` work a call returns.

`AttentionChannel` and `FFNChannel` (`afd_ray.connector.channel`) hold one `Pair` per
pair and use nothing else of a transport; the implementations are `ShmPair`
(`afd_ray.connector.shm`), `GroupPair` (`gloo`/`nccl`/`hccl`,
`afd_ray.connector.group_pair`) and `CudaIpcPair` (`afd_ray.connector.cuda_ipc`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

import torch

__all__ = ["Done", "Pair", "Pending", "Side"]

Side = Literal["attention", "ffn"]
"""Which end of a pair a process holds: `attention` sends A2F and receives F2A, `ffn`
the reverse."""


class Pending(Protocol):
    """Work queued on a link or pair (a send or a receive)."""

    def wait(self) -> None:
        """Block until the work is done (bounded by the link's `timeout_s`). On CUDA
        transports the wait may be queued on the current stream instead of the host.

        Raises:
            PeerLostError: the peer is gone.
        """


class Done:
    """A `Pending` with nothing left to do: the work is done, or queued on the
    current CUDA stream."""

    def wait(self) -> None:
        return None


@runtime_checkable
class Pair(Protocol):
    """One side of a pair's data plane, opened by its transport's `open_*` function
    (which blocks until the other side opened its own).

    A message is a list of contiguous tensors on the pair's device, in the order of
    the link contract (`afd_ray.connector.link`): A2F `[T_u, H]` model dtype (then,
    with `gate_on_attention`, top-k ids `[T_u, k]` int64 and weights `[T_u, k]`
    float32); F2A `[T_u, H]` (or `[T_u, P, H]`). The receiver's `outs` have the shapes
    and dtypes the sender used. `ubatch` is in `[0, ubatches)` of the opening.

    Errors: `PeerLostError` (the peer is gone, did not answer within the pair's
    timeout, or the pair was closed: "pair closed"); `ValueError` (a tensor not
    contiguous, or a message a slot cannot hold).
    """

    def send(self, tensors: Sequence[torch.Tensor], ubatch: int) -> Pending:
        """Queue the message `tensors` to the peer on `ubatch`; they belong to the
        pair until the `Pending` is waited on."""

    def recv(self, outs: Sequence[torch.Tensor], ubatch: int) -> Pending:
        """Queue the receive of the peer's next message on `ubatch` into `outs`;
        they hold it once the `Pending` is waited on."""

    def exchange(self, sends: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], ubatch: int) -> None:
        """`sends`, then the peer's answer into `outs` (the attention side's layer),
        blocking."""

    def close(self) -> None:
        """Release the pair (once); waits a transport can wake (`shm`, `gloo`) fail
        with `PeerLostError` "pair closed"."""
