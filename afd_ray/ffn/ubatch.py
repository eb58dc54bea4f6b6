"""One ubatch of an FFN step: the buffer views its peers' rows go to, and its exchange.

DBO across attention ranks: the FFN loop serves a step's peers in up to
`FFNPoolConfig.ubatches` groups (ubatches) per layer, one after the other, so that one
group's attention runs while this rank computes another's (`FormedStep.ubatches`).
Per layer a ubatch receives every live peer's A2F into its views, the layer runs on
the ubatch's rows (`FFNGraphs.run`), and each live peer gets its own rows back (F2A).
An attention peer lost on the way (`PeerLostError`) gets nothing more; its rows are
zeroed, so the rest of the step computes on finite values (expert 0, weight 0).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from afd_ray.connector.header import StepHeader
from afd_ray.connector.link import FFNLink, PeerLostError
from afd_ray.ffn.graphs import FFNGraphs, StepInputs

__all__ = ["Ubatch"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ubatch:
    """A ubatch of a step: its peers (`steps`), the buffers their rows go to, each
    peer's rows `T_i` and their sum, and per peer the views `[T_i, H]` into
    `inputs.hidden` and, with `gate_on_attention`, the top-k ids and weights `[T_i, k]`
    into `inputs.routing`."""

    steps: tuple[StepHeader, ...]
    inputs: StepInputs
    sizes: list[int]
    rows: int
    hidden: tuple[torch.Tensor, ...]
    topk: list[tuple[torch.Tensor, torch.Tensor] | None]

    @classmethod
    def of(cls, compute: FFNGraphs, steps: tuple[StepHeader, ...], padded: int | None) -> Ubatch:
        """The ubatch of `steps`' peers over `compute`'s buffers, made once per step.

        Args:
            padded: rows the buffers must hold (with EP: the group's largest local
                count, the same on every EP rank); None: exactly the ubatch's rows.
        """
        sizes = [step.num_tokens for step in steps]
        rows = sum(sizes)
        inputs = compute.inputs(rows if padded is None else padded)
        hidden = inputs.hidden[:rows].split(sizes)  # [T_i, H] views
        if inputs.routing is None:
            topk: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(steps)
        else:
            topk = list(zip(*(t[:rows].split(sizes) for t in inputs.routing)))  # [T_i, k] ids, weights views
        return cls(steps, inputs, sizes, rows, hidden, topk)

    def receive(self, channel: FFNLink, layer: int, lost: set[int]) -> None:
        """A2F of `layer` from each peer not in `lost` into its views; a peer lost now
        joins `lost` and its rows are zeroed."""
        for step, rows, topk in zip(self.steps, self.hidden, self.topk):
            if step.peer in lost:
                continue
            try:
                channel.recv_a2f(step.peer, rows, topk)
            except PeerLostError as exc:
                _lost(step.peer, layer, exc, lost)
                for part in (rows, *(topk or ())):
                    part.zero_()

    def send(self, channel: FFNLink, out: torch.Tensor, layer: int, lost: set[int]) -> int:
        """F2A of `layer`: each peer not in `lost` gets its rows of `out` (`[rows, H]`, or
        `[rows, P, H]` for a split MoE layer); a peer lost now joins `lost`. Returns the
        bytes sent."""
        sent = 0
        for step, peer_out in zip(self.steps, out.split(self.sizes)):
            if step.peer not in lost:
                try:
                    channel.send_f2a(step.peer, peer_out)
                    sent += peer_out.nbytes
                except PeerLostError as exc:
                    _lost(step.peer, layer, exc, lost)
        return sent


def _lost(peer: int, layer: int, exc: PeerLostError, lost: set[int]) -> None:
    logger.warning("FFN lost attention rank %d at layer %d (%s); the step goes on without it", peer, layer, exc)
    lost.add(peer)
