"""Preallocated A2F/F2A receive buffers, one per bucketed token count.

A CUDA graph replays fixed addresses, so both sides of a pair receive into buffers
allocated once, before capture: for each token-count bucket and each slot (one slot
per micro-batch, so the two ubatches of DBO never share one), a `[bucket, H]` tensor.
A step of `T` rows uses the first `T` rows of the buffer of the smallest bucket
`>= T`; both sides derive the bucket from the step header's `num_tokens`.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

__all__ = ["RecvBuffers"]


class RecvBuffers:
    """`[bucket, H]` receive buffers for every bucket and slot.

    Args:
        buckets: token counts to allocate for, e.g. `(1, 16, 128, 512)`; sorted and
            de-duplicated here.
        hidden_size: H.
        dtype: model dtype of the A2F/F2A tensors.
        device: device of the buffers (the pair group's device).
        slots: buffers per bucket (one per micro-batch in flight).

    Memory: `sum(buckets) * H * slots * dtype_bytes`.

    Raises:
        ValueError: no bucket, a bucket < 1, or `slots` < 1.
    """

    def __init__(
        self,
        buckets: Sequence[int],
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        slots: int = 1,
    ) -> None:
        self.buckets = sorted(set(buckets))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets must be positive token counts, got {list(buckets)}")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self._buffers = {
            bucket: [torch.empty(bucket, hidden_size, dtype=dtype, device=device) for _ in range(slots)]
            for bucket in self.buckets
        }

    def bucket(self, num_tokens: int) -> int:
        """The smallest bucket that holds `num_tokens` rows.

        Raises:
            ValueError: `num_tokens` < 1 or above the largest bucket.
        """
        i = bisect.bisect_left(self.buckets, num_tokens)
        if num_tokens < 1 or i == len(self.buckets):
            raise ValueError(f"num_tokens {num_tokens} outside the buckets {self.buckets}")
        return self.buckets[i]

    def get(self, num_tokens: int, slot: int = 0) -> torch.Tensor:
        """`[num_tokens, H]` view of the first rows of the buffer of `bucket(num_tokens)`
        in `slot` (the same memory on every call)."""
        return self._buffers[self.bucket(num_tokens)][slot][:num_tokens]
