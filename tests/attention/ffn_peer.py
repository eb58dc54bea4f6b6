"""A real FFN peer in the test process: an FFN runtime over `shm` serving an FFN stack,
with an `FFNClient` on it bound as this process's (`ffn_op.use_ffn_client`), so AFD
model code calls it as an attention rank would."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from afd_ray.attention.ffn_client import FFNClient
from afd_ray.attention.ffn_op import use_ffn_client
from afd_ray.attention.ffn_op import close_ffn_client
from afd_ray.connector.channel import FFNChannel
from afd_ray.control.membership import AttentionAssignment
from afd_ray.ffn.model import FFNStack
from afd_ray.ffn.runtime import FFNRuntime


@contextmanager
def ffn_peer(stack: FFNStack, dtype: torch.dtype, timeout_s: float) -> Iterator[FFNStack]:
    """Serve `stack` (activations in `dtype`) until the block ends, then close the
    client and stop the runtime; every wait of either side is bounded by `timeout_s`."""
    channel = FFNChannel("127.0.0.1", "gloo", timeout_s=timeout_s)
    runtime = FFNRuntime(stack, channel, dtype, poll_s=0.05, batch_window_s=0.01)
    loop = threading.Thread(target=runtime.run)
    loop.start()
    assignment = AttentionAssignment.to_ffn(channel.address, 0, 0, 0, "shm", timeout_s)
    try:
        use_ffn_client(FFNClient(assignment))
        yield stack
    finally:
        close_ffn_client()
        runtime.stop()
        loop.join(timeout_s)
