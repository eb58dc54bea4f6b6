"""A loopback FFN: the FFN side of the connector contract (`afd_ray.connector.link`)
with no model, answering every layer with a function of its A2F (by default the A2F
itself). It is the oracle of the transports' tests (`tests/connector`), and the FFN
peer of the link measurement (`afd_ray.plan.link`) and of the transport
microbenchmark (`afd_ray.bench.transport`).

Per `STEP(T, first_layer)` header of a peer, for each FFN layer `l` from `first_layer`
to `layers - 1`, for each ubatch `u` of `T_u` rows (one ubatch of `T` unless told):

| direction | tensors | shape | dtype |
|---|---|---|---|
| A2F | hidden states | `[T_u, H]` | `dtype` (float32 unless told) |
| A2F, `top_k` > 0 only | top-k ids, top-k weights | `[T_u, k]`, `[T_u, k]` | int64, float32 |
| F2A | `answer(l, hidden)` | `[T_u, H]` | `dtype` |
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Sequence

import torch

from afd_ray.connector.channel import FFNChannel
from afd_ray.connector.header import HeaderKind, StepHeader
from afd_ray.connector.link import FFNLink
from afd_ray.platform import Backend

__all__ = ["Answer", "LoopbackFFN", "echo", "serve_loopback_ffn"]

Answer = Callable[[int, torch.Tensor], torch.Tensor]
"""`answer(layer, hidden)`: the F2A `[T_u, H]` of FFN layer `layer` for the A2F
`hidden` `[T_u, H]` (same dtype; it may return `hidden` itself)."""


def echo(layer: int, hidden: torch.Tensor) -> torch.Tensor:
    """The default `Answer`: the A2F itself, bit for bit."""
    return hidden


class LoopbackFFN:
    """Answers the steps of its link's peers (see the module docstring for the
    messages).

    Args:
        link: the FFN side of the pairs (an `FFNChannel` of any transport).
        hidden_size: H.
        layers: FFN layers per step.
        dtype: dtype of the A2F and F2A rows.
        answer: the F2A of each layer (default `echo`).
        top_k: k of the top-k ids and weights each A2F carries (`gate_on_attention`);
            0: none.

    Attributes:
        topk: ids `[T_u, k]` int64 and weights `[T_u, k]` float32 of the last A2F
            received, with `top_k` > 0; else None.
    """

    def __init__(
        self,
        link: FFNLink,
        hidden_size: int,
        layers: int,
        dtype: torch.dtype = torch.float32,
        answer: Answer = echo,
        top_k: int = 0,
    ) -> None:
        self.link, self.hidden_size, self.layers, self.dtype = link, hidden_size, layers, dtype
        self.answer, self.top_k = answer, top_k
        self.topk: tuple[torch.Tensor, torch.Tensor] | None = None
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}
        """Receive buffer `[rows, H]` per (ubatch, rows), reused across steps."""

    def serve_step(self, header: StepHeader, rows: Sequence[int] | None = None) -> None:
        """Answer every FFN layer of the step `header` announced, from its
        `first_layer` on.

        Args:
            header: a STEP of an admitted peer.
            rows: rows `T_u` of each ubatch, summing to `header.num_tokens` (the
                attention side's split); None: one ubatch of all rows.

        Raises:
            PeerLostError: the peer is gone.
            ValueError: `rows` does not sum to the header's rows.
        """
        rows = [header.num_tokens] if rows is None else list(rows)
        if sum(rows) != header.num_tokens:
            raise ValueError(f"rows {rows} do not sum to the step's {header.num_tokens} rows")
        for layer in range(header.first_layer, self.layers):
            for ubatch, count in enumerate(rows):
                hidden = self._buffer(ubatch, count)
                if self.top_k:  # the blocking receive is the one that carries the top-k
                    shape = (count, self.top_k)
                    self.topk = (torch.empty(shape, dtype=torch.int64), torch.empty(shape, dtype=torch.float32))
                    self.link.recv_a2f(header.peer, hidden, self.topk, ubatch)
                else:
                    self.link.irecv_a2f(header.peer, hidden, ubatch).wait()
                self.link.isend_f2a(header.peer, self.answer(layer, hidden).contiguous(), ubatch).wait()

    def serve(self, idle_s: float, peers: int | None = None) -> None:
        """Answer headers until none arrives within `idle_s` seconds (or one was
        dropped), or until `peers` peers have left: a JOIN admits its peer, a STEP is
        answered (`serve_step`), a LEAVE closes its pair.

        Raises:
            PeerLostError: a peer is gone, or did not rendezvous.
        """
        left = 0
        while (peers is None or left < peers) and (header := self.link.recv_header(idle_s)) is not None:
            if header.kind is HeaderKind.JOIN:
                self.link.admit(header.peer)
            elif header.kind is HeaderKind.LEAVE:
                self.link.remove(header.peer)
                left += 1
            else:
                self.serve_step(header)

    def _buffer(self, ubatch: int, rows: int) -> torch.Tensor:
        key = (ubatch, rows)
        if key not in self._buffers:
            self._buffers[key] = torch.empty(rows, self.hidden_size, dtype=self.dtype)
        return self._buffers[key]


def serve_loopback_ffn(
    queue: mp.Queue,
    backend: Backend,
    hidden_size: int,
    layers: int,
    timeout_s: float,
    dtype: torch.dtype = torch.float32,
    peers: int | None = None,
    make_answer: Callable[[], Answer] | None = None,
    threads: int | None = None,
) -> None:
    """A process target (spawn): open an `FFNChannel` on loopback with `backend`, put
    its `FFNAddress` on `queue`, then `LoopbackFFN.serve(timeout_s, peers)` and close.

    Args:
        make_answer: builds the `Answer` in this process (a picklable callable);
            None: `echo`.
        threads: torch threads of this process; None leaves torch's default.
        (The others as `LoopbackFFN`; `timeout_s` also bounds every wait of the link.)
    """
    if threads is not None:
        torch.set_num_threads(threads)
    channel = FFNChannel("127.0.0.1", backend, timeout_s)
    queue.put(channel.address)
    try:
        answer = echo if make_answer is None else make_answer()
        LoopbackFFN(channel, hidden_size, layers, dtype, answer).serve(timeout_s, peers)
    finally:
        channel.close()
