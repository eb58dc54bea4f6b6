"""Stateless torch process groups over a `TCPStore` rendezvous.

Each attention↔FFN pair (and later each FFN EP group) gets its own small process group,
created and destroyed on its own when membership changes, with no global
`torch.distributed` state and no re-init of the others.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch._C._distributed_c10d as c10d
import torch.distributed as dist

from afd_ray.platform import Backend

__all__ = ["new_process_group", "registered_gloo_group", "unregister_group"]


def new_process_group(
    backend: Backend, store: dist.Store, rank: int, world_size: int, timeout_s: float
) -> dist.ProcessGroup:
    """Build a process group of `world_size` ranks that rendezvous through `store`.

    Args:
        backend: `gloo` (CPU), `nccl` (CUDA) or `hccl` (Ascend, needs torch-npu).
        store: a store shared by all ranks, usually a `PrefixStore` unique to the group.
        rank: this process's rank in `[0, world_size)`.
        world_size: number of ranks.
        timeout_s: bound on every blocking operation of the group, seconds.

    Blocks until all `world_size` ranks have joined (bounded by the store's timeout).

    Raises:
        ValueError: unknown backend.
        RuntimeError / DistStoreError: rendezvous failed or timed out.
    """
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    if backend == "hccl":
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL

        options = ProcessGroupHCCL.Options()
        options._timeout = timeout
        return ProcessGroupHCCL(store, rank, world_size, options)
    raise ValueError(f"connector backend: unknown {backend!r}; expected gloo, nccl or hccl")


def registered_gloo_group(
    store: dist.Store, rank: int, world_size: int, timeout_s: float, name: str
) -> dist.ProcessGroup:
    """A gloo `ProcessGroup` of `world_size` ranks over `store`, registered under
    `name` in this process, for APIs that find a group by name: torch's
    symmetric-memory `rendezvous` (it exchanges its handles through the group's store).
    Still no global `torch.distributed` state: only the name table entry, which
    `unregister_group` removes.

    Blocks until all ranks have joined; raises as `new_process_group`.
    """
    backend = dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))
    group = dist.ProcessGroup(store, rank, world_size)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    group._set_group_name(name)
    c10d._register_process_group(name, group)
    return group


def unregister_group(name: str) -> None:
    """Remove `name` from this process's group name table (`registered_gloo_group`)."""
    c10d._unregister_process_group(name)
