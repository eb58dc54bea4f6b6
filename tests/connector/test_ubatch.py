"""Micro-batches on the connector contract: a two-ubatch (DBO) schedule over each CPU
transport (one gloo pair group per ubatch, or one shm slot pair per ubatch) gives the
colocated step's numbers, and steps with and without DBO share one pair."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from afd_ray.connector.channel import AttentionChannel, FFNChannel
from afd_ray.connector.link import AttentionLink, FFNLink
from afd_ray.connector.loopback import LoopbackFFN
from afd_ray.connector.pair import Pending

H = 8
LAYERS = 3


def _ffn(layer: int, hidden: torch.Tensor) -> torch.Tensor:
    return hidden * (layer + 2) + 1


def _halves(rows: int, ubatches: int) -> list[slice]:
    """Rows split into `ubatches` contiguous slices (the first one larger)."""
    first = (rows + 1) // 2 if ubatches == 2 else rows
    return [slice(0, first), slice(first, rows)][:ubatches]


def _step(x: torch.Tensor, ubatches: int, link: AttentionLink | None) -> torch.Tensor:
    """One step of an elementwise toy decoder (so row splits cannot change the numbers).
    With `link`, per layer: A2F of every ubatch is queued before the F2A of the first is
    waited on (the ping-pong of DBO); without, the FFN is computed in place."""
    residual = x.clone()
    slices = _halves(x.shape[0], ubatches)
    for layer in range(LAYERS):
        pending: list[tuple[torch.Tensor, list[Pending]]] = []
        for u, rows in enumerate(slices):
            hidden = residual[rows]
            hidden = hidden + torch.tanh(hidden) * (layer + 1)  # "attention"
            if link is None:
                pending.append((_ffn(layer, hidden), []))
            else:
                out = torch.empty_like(hidden)
                pending.append((out, [link.isend_a2f(hidden, u), link.irecv_f2a(out, u)]))
        for rows, (out, works) in zip(slices, pending, strict=True):
            for work in works:
                work.wait()
            residual[rows] += out
    return residual


def _serve(ffn: FFNLink, ubatches: int, errors: list[BaseException]) -> None:
    """The FFN side of one step: per layer and ubatch, receive, compute, send back."""
    try:
        header = ffn.recv_header(10)
        rows = [s.stop - s.start for s in _halves(header.num_tokens, ubatches)]
        LoopbackFFN(ffn, H, LAYERS, answer=_ffn).serve_step(header, rows)
    except BaseException as exc:
        errors.append(exc)


def test_dbo_schedule_over_one_pair_per_ubatch_matches_the_colocated_step(
    transport: str, open_pair: Callable[..., AttentionChannel]
) -> None:
    ffn = FFNChannel("127.0.0.1", "gloo", timeout_s=10, ubatch_groups=2)
    attention = open_pair(ffn, 0, transport, ubatch_groups=2)
    for tokens, ubatches in ((7, 2), (1, 1), (16, 2)):  # DBO on, off, on over the same pair
        errors: list[BaseException] = []
        server = threading.Thread(target=_serve, args=(ffn, ubatches, errors))
        server.start()
        x = torch.randn(tokens, H)
        attention.send_header(tokens)
        assert torch.equal(_step(x, ubatches, attention), _step(x, 1, None))
        server.join(10)
        assert not server.is_alive() and errors == []
    attention.close()
    ffn.close()


def test_ubatch_groups_must_be_positive() -> None:
    with pytest.raises(ValueError, match="ubatch_groups"):
        FFNChannel("127.0.0.1", "gloo", timeout_s=1, ubatch_groups=0)
