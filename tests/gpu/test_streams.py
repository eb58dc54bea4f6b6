"""`devices.pooled_stream_other_than` on CUDA: over more draws than torch's pool holds
(32 streams per device and priority, handed out round-robin), the stream it returns is
never the one the caller named; a plain `torch.cuda.Stream()` would be, once per lap.
Skips visibly without a CUDA device."""

from __future__ import annotations

import pytest
import torch

from afd_ray.devices import pooled_stream_other_than

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)"),
]


def test_a_drawn_stream_is_never_the_callers() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    serving = torch.cuda.Stream(device)
    with torch.cuda.stream(serving):
        current = torch.cuda.current_stream(device).cuda_stream
        plain = [torch.cuda.Stream(device).cuda_stream for _ in range(64)]
        drawn = [pooled_stream_other_than(device, current).cuda_stream for _ in range(64)]
    assert current in plain  # the hazard: the pool hands the serving stream out again
    assert current not in drawn
