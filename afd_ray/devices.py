"""The torch side of a platform (`afd_ray.platform`): the device of a pool member, and
CUDA streams drawn from torch's pool."""

from __future__ import annotations

import torch

from afd_ray.platform import Platform, platform_spec

__all__ = ["pooled_stream_other_than", "torch_device"]


def torch_device(platform: Platform) -> torch.device:
    """The torch device of a pool member (its Ray actor sees only its own devices)."""
    return torch.device(platform_spec(platform).device_type)


def pooled_stream_other_than(device: torch.device, stream: int) -> torch.cuda.Stream:
    """A CUDA stream of `device` from torch's pool that is not `stream` (a CUDA stream
    handle, e.g. `torch.cuda.current_stream().cuda_stream`). torch hands its pooled
    streams out round-robin (32 per device and priority), so a new
    `torch.cuda.Stream()` may be one the caller already queues work on, and what it
    meant to run beside that work would run behind it; another is drawn then."""
    other = torch.cuda.Stream(device)
    while other.cuda_stream == stream:
        other = torch.cuda.Stream(device)
    return other
