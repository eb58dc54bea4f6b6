"""What differs between the platforms `cpu`, `cuda` and `npu`, in one table: the torch
device type, the collective backend of the connector and EP groups, the Ray resource
key of a pool member's bundle, and the environment variable that limits a process to
its devices. Nothing else in the code branches on the platform name. No torch: the
torch side of a platform (its device, CUDA streams) is `afd_ray.devices`.

The NPU row follows torch-npu and Ray's NPU accelerator support; it is unverified (no
NPU to run on). It needs `torch_npu` imported before its device or backend is used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, TypedDict

__all__ = [
    "DATA_PLANE_NICE",
    "ActorResources",
    "Backend",
    "Platform",
    "PlatformSpec",
    "actor_resources",
    "collective_backend",
    "lower_data_plane_priority",
    "platform_spec",
    "resource_key",
    "visible_devices_env",
]


Platform = Literal["cpu", "cuda", "npu"]
"""`AFDConfig.platform`: the device kind both pools run on."""
Backend = Literal["gloo", "nccl", "hccl"]
"""A torch process-group backend of the connector and EP groups (CPU, CUDA, Ascend)."""


@dataclass(frozen=True)
class PlatformSpec:
    """How one platform is named by torch, torch.distributed and Ray."""

    device_type: str
    """torch device type: `cpu`, `cuda` or `npu`."""
    backend: Backend
    """torch process-group backend: `gloo`, `nccl` or `hccl`."""
    resource_key: str
    """Ray resource key of one device: `CPU`, `GPU` or `NPU`."""
    visible_devices: str | None
    """Environment variable listing the device indices a process may use, which Ray
    sets for an actor that claims the resource (`CUDA_VISIBLE_DEVICES`,
    `ASCEND_RT_VISIBLE_DEVICES`); None for CPU."""


_PLATFORMS: dict[Platform, PlatformSpec] = {
    "cpu": PlatformSpec("cpu", "gloo", "CPU", None),
    "cuda": PlatformSpec("cuda", "nccl", "GPU", "CUDA_VISIBLE_DEVICES"),
    "npu": PlatformSpec("npu", "hccl", "NPU", "ASCEND_RT_VISIBLE_DEVICES"),
}


class ActorResources(TypedDict, total=False):
    """The resource part of Ray's actor options (`ray_actor_options` in Serve)."""

    num_cpus: float
    num_gpus: float
    resources: dict[str, float]


def platform_spec(platform: Platform) -> PlatformSpec:
    """The row of `platform` (`cpu`, `cuda` or `npu`)."""
    return _PLATFORMS[platform]


def resource_key(platform: Platform) -> str:
    """The Ray resource key of one device of `platform`: `CPU`, `GPU` or `NPU`."""
    return _PLATFORMS[platform].resource_key


def actor_resources(platform: Platform, amount: float) -> ActorResources:
    """Actor options that claim `amount` of `resource_key(platform)`, nothing else.

    A replica with `placement_group_bundles` runs in the first bundle, so it must
    ask for exactly that bundle. Ray spells CPU and GPU as `num_cpus`/`num_gpus`
    (which also sets `CUDA_VISIBLE_DEVICES`) and any other key under `resources`
    (for `NPU` Ray sets `ASCEND_RT_VISIBLE_DEVICES`).
    """
    key = resource_key(platform)
    if key == "CPU":
        return {"num_cpus": amount}
    if key == "GPU":
        return {"num_cpus": 0, "num_gpus": amount}
    return {"num_cpus": 0, "resources": {key: amount}}


def collective_backend(platform: Platform) -> Backend:
    """The torch process-group backend of the connector and EP groups: gloo, nccl or hccl."""
    return _PLATFORMS[platform].backend


def visible_devices_env(platform: Platform) -> str | None:
    """The environment variable that limits a process to some devices of `platform`
    (`CUDA_VISIBLE_DEVICES`, `ASCEND_RT_VISIBLE_DEVICES`), or None for CPU."""
    return _PLATFORMS[platform].visible_devices


DATA_PLANE_NICE = 5
"""Niceness the model's compute adds to the calling thread (`lower_data_plane_priority`)."""


def lower_data_plane_priority() -> None:
    """Lower the calling thread's CPU priority by `DATA_PLANE_NICE` (Linux niceness is
    per thread; threads and processes it starts later inherit it): the attention
    replica's event-loop thread before it spawns vLLM's EngineCore (that thread, which
    streams the replica's tokens, stays lowered too), the FFN rank's compute loop. The
    control plane on the same cores (the ingress deciding admission, HAProxy, the
    coordinator, Ray and Serve's health checks) then runs first when the cores are
    full, so a refusal under overload does not queue behind model steps. Raising the
    niceness needs no privilege; it cannot be undone without one."""
    os.nice(DATA_PLANE_NICE)
