"""The FFN runtime: a loop driven by the connector, with no scheduler and no KV cache.

Each iteration: read one step header; JOIN/LEAVE change the peer set at this step
boundary; STEP(T) runs every FFN layer in order: receive `[T, H]` (A2F), compute,
send `[T, H]` back (F2A). The loop owns nothing across steps except the weights and
the counters in `FFNStats`, so a lost FFN rank loses no request data.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace

import torch

from afd_ray.connector.channel import FFNChannel
from afd_ray.connector.header import HeaderKind, StepHeader
from afd_ray.ffn.model import FFNStack

__all__ = ["FFNRuntime", "FFNStats"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FFNStats:
    """Counters of one FFN rank since start; replaced whole at each step boundary, so a
    snapshot read from another thread is always consistent."""

    steps: int = 0
    """Forward steps served."""
    layers: int = 0
    """FFN layer computations (steps x layers)."""
    tokens: int = 0
    """Token rows served, summed over steps (not over layers)."""
    busy_s: float = 0.0
    """Wall time spent inside steps (receive + compute + send), seconds."""


class FFNRuntime:
    """Serves the FFN half of every layer to the attention peers of one channel.

    Args:
        model: the FFN blocks of every layer, on `device`, in the model dtype.
        channel: the FFN side of the connector.
        dtype: dtype of the A2F/F2A tensors (the model dtype).
        poll_s: longest wait for a header before the stop flag is checked, seconds
            (a header wakes the loop at once).
    """

    def __init__(self, model: FFNStack, channel: FFNChannel, dtype: torch.dtype, poll_s: float) -> None:
        self.model = model
        self.channel = channel
        self.stats = FFNStats()
        self._dtype = dtype
        self._poll_s = poll_s
        self._hidden = model.layers[0].down_proj.out_features
        self._device = model.layers[0].down_proj.weight.device
        self._stop = threading.Event()

    def run(self) -> None:
        """Serve headers until `stop()`; then close the channel (same thread)."""
        try:
            while not self._stop.is_set():
                header = self.channel.recv_header(self._poll_s)
                if header is not None:
                    self._handle(header)
        finally:
            self.channel.close()

    def stop(self) -> None:
        """Ask `run()` to return within one poll interval."""
        self._stop.set()

    def _handle(self, header: StepHeader) -> None:
        if header.kind is HeaderKind.JOIN:
            self.channel.admit(header.peer)
            logger.info("FFN admitted attention rank %d (epoch %d)", header.peer, header.epoch)
        elif header.kind is HeaderKind.LEAVE:
            self.channel.remove(header.peer)
            logger.info("attention rank %d left", header.peer)
        else:
            self._step(header)

    @torch.inference_mode()
    def _step(self, header: StepHeader) -> None:
        start = time.perf_counter()
        hidden = torch.empty(header.num_tokens, self._hidden, dtype=self._dtype, device=self._device)
        for layer in range(self.model.num_layers):
            self.channel.recv_a2f(header.peer, hidden)
            self.channel.send_f2a(header.peer, self.model(layer, hidden))
        stats = self.stats
        self.stats = replace(
            stats,
            steps=stats.steps + 1,
            layers=stats.layers + self.model.num_layers,
            tokens=stats.tokens + header.num_tokens,
            busy_s=stats.busy_s + time.perf_counter() - start,
        )
