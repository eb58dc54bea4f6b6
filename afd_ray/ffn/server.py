"""One FFN rank as a Serve replica: loads its weights, runs the FFN loop in a thread.

It takes no user requests (no route leads here) and allocates no KV cache.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from datetime import timedelta

import ray
import torch
import torch.distributed as dist
from ray.serve.handle import DeploymentHandle

from afd_ray.config import ConnectorConfig, FFNPoolConfig, GatePlacement, ModelConfig, Platform
from afd_ray.connector.channel import FFNChannel
from afd_ray.connector.process_group import new_process_group
from afd_ray.control.membership import EPAssignment
from afd_ray.ffn.ep import EPGroup
from afd_ray.ffn.model import load_ffn_stack
from afd_ray.ffn.moe import MoE
from afd_ray.ffn.runtime import FFNRuntime
from afd_ray.models.embedded import resolve_checkpoint
from afd_ray.platform import collective_backend, torch_device

__all__ = ["FFNServer"]

_REPORT_PERIOD_S = 0.2
_STOP_POLL_S = 0.1
"""Header wait between checks of the stop flag; a header wakes the loop at once."""


def _ep_process_group(assignment: EPAssignment) -> dist.ProcessGroup:
    """Join the FFN pool's EP group (blocks until every FFN rank joined)."""
    store = dist.TCPStore(
        assignment.host, assignment.store_port, is_master=False,
        timeout=timedelta(seconds=assignment.timeout_s),
    )
    return new_process_group(
        assignment.backend, dist.PrefixStore(f"afd/ep/{assignment.epoch}", store),
        assignment.ep_rank, assignment.ep_size, assignment.timeout_s,
    )


class FFNServer:
    """Body of the FFN pool's Serve deployment."""

    async def __init__(
        self,
        platform: Platform,
        model: ModelConfig,
        ffn: FFNPoolConfig,
        connector: ConnectorConfig,
        gate_placement: GatePlacement,
        coordinator: DeploymentHandle,
    ) -> None:
        """Open the connector, register with the coordinator, load this rank's FFN-role
        weights (its EP shard of the routed experts), join the EP group, start the loop.

        Raises:
            ValueError: the checkpoint's architecture has no FFN implementation.
        """
        torch.set_num_threads(ffn.num_threads)
        dtype = getattr(torch, model.dtype)
        device = torch_device(platform)
        channel = FFNChannel(
            connector.host or ray.util.get_node_ip_address(), collective_backend(platform), connector.timeout_s
        )
        self._coordinator = coordinator
        self.rank = await coordinator.register_ffn.remote(channel.address)
        assignment = await coordinator.ep_assignment.remote(self.rank, connector.timeout_s)
        stack = load_ffn_stack(
            resolve_checkpoint(model), dtype, device, assignment.ep_rank, assignment.ep_size,
            gate_on_attention=gate_placement == "gate_on_attention",
        )
        moe = [block for block in stack.layers if isinstance(block, MoE)]
        ep = None
        if assignment.ep_size > 1 and moe:
            group = await asyncio.to_thread(_ep_process_group, assignment)
            ep = EPGroup(group, moe[0].spec.num_experts, device)
        poll_s = ffn.ep_idle_check_us / 1e6 if ep is not None else _STOP_POLL_S
        self._runtime = FFNRuntime(stack, channel, dtype, poll_s, connector.batch_window_us / 1e6, ep)
        self._loop = threading.Thread(target=self._runtime.run, name=f"afd-ffn-{self.rank}", daemon=True)
        self._loop.start()
        self._reporter = asyncio.create_task(self._report())

    async def _report(self) -> None:
        while True:
            runtime = self._runtime
            await self._coordinator.report_ffn.remote(self.rank, runtime.stats, runtime.expert_tokens.tolist())
            await asyncio.sleep(_REPORT_PERIOD_S)

    async def param_bytes(self) -> dict[str, int]:
        """Resident parameter bytes of this rank's FFN model, keyed by parameter name
        without layer indices (e.g. `layers.down_proj.weight`)."""
        totals: dict[str, int] = defaultdict(int)
        for name, param in self._runtime.model.named_parameters():
            key = ".".join(p for p in name.split(".") if not p.isdigit())
            totals[key] += param.numel() * param.element_size()
        return dict(totals)

    async def check_health(self) -> None:
        """Serve's health check.

        Raises:
            RuntimeError: the FFN loop thread has exited (it failed).
        """
        if not self._loop.is_alive():
            raise RuntimeError(f"FFN rank {self.rank}: loop thread exited")

    def __del__(self) -> None:
        if hasattr(self, "_runtime"):
            self._runtime.stop()
