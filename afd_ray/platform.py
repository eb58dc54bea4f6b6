"""Platform-specific choices that the Ray side needs: the resource key of a pool
member's bundle and how a replica actor claims it."""

from __future__ import annotations

from typing import TypedDict

import torch

from afd_ray.config import Platform

__all__ = [
    "ActorResources",
    "actor_resources",
    "collective_backend",
    "resource_key",
    "torch_device",
]

_RESOURCE_KEYS: dict[Platform, str] = {"cpu": "CPU", "cuda": "GPU", "npu": "NPU"}


class ActorResources(TypedDict, total=False):
    """The resource part of Ray's actor options (`ray_actor_options` in Serve)."""

    num_cpus: float
    num_gpus: float
    resources: dict[str, float]


def resource_key(platform: Platform) -> str:
    """The Ray resource key of one device of `platform`: `CPU`, `GPU` or `NPU`."""
    return _RESOURCE_KEYS[platform]


def actor_resources(platform: Platform, amount: float) -> ActorResources:
    """Actor options that claim `amount` of `resource_key(platform)`, nothing else.

    A replica with `placement_group_bundles` runs in the first bundle, so it must
    ask for exactly that bundle. Ray spells CPU and GPU as `num_cpus`/`num_gpus`
    (which also sets `CUDA_VISIBLE_DEVICES`) and any other key under `resources`.
    """
    key = resource_key(platform)
    if key == "CPU":
        return {"num_cpus": amount}
    if key == "GPU":
        return {"num_cpus": 0, "num_gpus": amount}
    return {"num_cpus": 0, "resources": {key: amount}}


_BACKENDS: dict[Platform, str] = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


def collective_backend(platform: Platform) -> str:
    """The torch process-group backend of the connector: gloo, nccl or hccl."""
    return _BACKENDS[platform]


def torch_device(platform: Platform) -> torch.device:
    """The torch device of a pool member (its Ray actor sees only its own devices)."""
    return torch.device({"cpu": "cpu", "cuda": "cuda", "npu": "npu"}[platform])
