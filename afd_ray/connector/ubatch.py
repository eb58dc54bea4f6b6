"""Micro-batches on the data plane: the two-ubatch overlap (DBO / ping-pong) schedule.

A step's `T` rows are split into `n` contiguous micro-batches (`ubatch_slices`; both
sides derive the split from the header's `num_tokens` and the configured `n`). With
`n = 2`, per layer ℓ the attention side runs

    attend(ℓ, 0) → A2F(ℓ, 0) → attend(ℓ, 1) → A2F(ℓ, 1) → wait F2A(ℓ, 0) → finish(ℓ, 0)
    → attend(ℓ+1, 0) → ...

so the attention of ubatch 1 runs while the FFN works on ubatch 0, and the attention
of ubatch 0 of the next layer while the FFN works on ubatch 1 (MegaScale-Infer's
ping-pong, arXiv:2504.02263 §4). Each ubatch has its own pair process group
(`ubatch_groups` of `afd_ray.connector.channel`; one slot pair per ubatch with `shm`), so on CUDA its transfers run on
their own NCCL stream. `n = 1` is the same schedule without overlap: that is the
switch to measure DBO on against off. The FFN side serves the ubatches in the same
order: receive, compute, send back.

On CUDA every call only queues work on streams, so a whole step of either side can be
captured in one CUDA graph; the step header (`send_header`) stays outside it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from afd_ray.connector.link import AttentionLink, FFNLink, Pending

__all__ = ["attention_layers", "ffn_layers", "ubatch_slices"]

Attend = Callable[[int, int], torch.Tensor]
"""`(layer, ubatch) -> [T_u, H]`: attention of one ubatch up to the post-attention norm
(the A2F tensor); it must stay unchanged until `Finish` of the same layer and ubatch."""
Finish = Callable[[int, int, torch.Tensor], None]
"""`(layer, ubatch, ffn_out [T_u, H])`: consume the F2A tensor (residual add)."""
FFNLayer = Callable[[int, torch.Tensor], torch.Tensor]
"""`(layer, hidden [N, H]) -> [N, H]`: one FFN block."""


def ubatch_slices(num_tokens: int, num_ubatches: int) -> list[slice]:
    """Rows `[0, num_tokens)` split into `num_ubatches` contiguous slices whose sizes
    differ by at most one (the first ones larger).

    Raises:
        ValueError: `num_ubatches` < 1 or more ubatches than rows.
    """
    if num_ubatches < 1 or num_tokens < num_ubatches:
        raise ValueError(f"cannot split {num_tokens} rows into {num_ubatches} ubatches")
    base, extra = divmod(num_tokens, num_ubatches)
    bounds = [0]
    for u in range(num_ubatches):
        bounds.append(bounds[-1] + base + (u < extra))
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


def attention_layers(
    num_layers: int,
    attend: Attend,
    finish: Finish,
    recv: list[torch.Tensor],
    channel: AttentionLink | None = None,
    ffn: FFNLayer | None = None,
) -> None:
    """Run every layer of one step over `len(recv)` ubatches, in the DBO order above.

    Args:
        num_layers: decoder layers L.
        attend, finish: the attention side of a layer (see `Attend`, `Finish`).
        recv: per ubatch, the `[T_u, H]` F2A receive buffer (preallocated,
            `afd_ray.connector.buffers`); with `ffn` it only gives the ubatch count.
        channel: the attention side of the pair (opened with `len(recv)` ubatch
            groups): AFD.
        ffn: instead of `channel`, the FFN computed in place (colocated baseline).

    Raises:
        ValueError: neither or both of `channel` and `ffn`.
    """
    if (channel is None) == (ffn is None):
        raise ValueError("attention_layers needs exactly one of channel (AFD) and ffn (colocated)")
    pending: list[tuple[int, torch.Tensor, list[Pending]] | None] = [None] * len(recv)

    def complete(u: int) -> None:
        layer, out, works = pending[u]
        for work in works:
            work.wait()
        finish(layer, u, out)
        pending[u] = None

    for layer in range(num_layers):
        for u in range(len(recv)):
            if pending[u] is not None:
                complete(u)
            hidden = attend(layer, u)
            if channel is None:
                pending[u] = (layer, ffn(layer, hidden), [])
            else:
                send = channel.isend_a2f(hidden, u)
                pending[u] = (layer, recv[u], [channel.irecv_f2a(recv[u], u), send])
    for u in range(len(recv)):
        complete(u)


def ffn_layers(
    num_layers: int,
    ffn: FFNLayer,
    recv: list[torch.Tensor],
    channel: FFNLink,
    peer: int,
) -> None:
    """Serve every layer of one step of `peer` over `len(recv)` ubatches: per layer and
    ubatch, receive A2F into `recv[u]` `[T_u, H]`, compute `ffn(layer, recv[u])`, send
    it back (F2A) on ubatch `u`'s pair group.

    The receive of a ubatch's next layer is queued right after its send, and both are
    waited on only when that ubatch needs its next input (their tensors are kept alive
    until then), so the FFN computes the other ubatch while a result is on the wire.
    """
    pending: list[list[Pending]] = [[channel.irecv_a2f(peer, buffer, u)] for u, buffer in enumerate(recv)]
    alive: list[torch.Tensor] = []
    for layer in range(num_layers):
        last = layer == num_layers - 1
        for u, buffer in enumerate(recv):
            for work in pending[u]:
                work.wait()
            out = ffn(layer, buffer).contiguous()
            alive.append(out)
            if last:
                pending[u] = [channel.isend_f2a(peer, out, u)]
            else:
                pending[u] = [channel.isend_f2a(peer, out, u), channel.irecv_a2f(peer, buffer, u)]
    for works in pending:
        for work in works:
            work.wait()
