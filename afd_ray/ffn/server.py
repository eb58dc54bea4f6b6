"""One FFN rank as a Serve replica: loads its weights, runs the FFN loop in a thread.

It takes no user requests (no route leads here) and allocates no KV cache. Its
report loop also brings back the coordinator's `LayoutPlan` during an FFN resize:
the rank then loads its shard of the new layout and opens the new EP group while the
old layout serves, and hands both to the loop, which switches at one agreed step
boundary (make before break). When Serve stops the replica (scale-in), its
destructor waits until the coordinator moved its peers and experts elsewhere.

Fencing: once the coordinator removed this rank (found dead, e.g. it was silent past
`ffn.heartbeat_timeout_s` while its process was stopped), the answer to its next
report says so; the rank then stops its loop (closing every attention pair, so its
peers fail over at once) and fails Serve's health check, and Serve replaces it. It
never serves again, not even under its old epoch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from contextlib import suppress
from datetime import timedelta
from pathlib import Path

import ray
import torch
import torch.distributed as dist
from ray import serve
from ray.serve.handle import DeploymentHandle

from afd_ray.config import (
    ConnectorConfig,
    FFNPoolConfig,
    GatePlacement,
    ModelConfig,
    ObservabilityConfig,
)
from afd_ray.connector.channel import FFNChannel
from afd_ray.connector.process_group import new_process_group
from afd_ray.control.membership import EPAssignment, FFNMember, LayoutPlan, LoopState, MemberState
from afd_ray.control.serve_api import app_deleting
from afd_ray.ffn.ep import EPGroup
from afd_ray.eplb.slots import layer_placements
from afd_ray.ffn.layout import LayoutSwitch
from afd_ray.ffn.model import FFNStack, load_ffn_stack
from afd_ray.ffn.runtime import FFNRuntime
from afd_ray.models.embedded import resolve_checkpoint
from afd_ray.observability.publish import FFNPublisher
from afd_ray.devices import torch_device
from afd_ray.platform import Platform, collective_backend, lower_data_plane_priority
from afd_ray.weights import resident_bytes

__all__ = ["FFNServer"]

logger = logging.getLogger("ray.serve")

_REPORT_PERIOD_S = 0.2
_STOP_POLL_S = 0.1
"""Header wait between checks of the stop flag; a header wakes the loop at once."""


def _ep_process_group(assignment: EPAssignment) -> dist.ProcessGroup:
    """Join the FFN pool's EP group (blocks until every FFN rank joined)."""
    store = dist.TCPStore(
        assignment.host,
        assignment.store_port,
        is_master=False,
        timeout=timedelta(seconds=assignment.timeout_s),
    )
    return new_process_group(
        assignment.backend,
        dist.PrefixStore(f"afd/ep/{assignment.epoch}", store),
        assignment.ep_rank,
        assignment.ep_size,
        assignment.timeout_s,
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
        observability: ObservabilityConfig = ObservabilityConfig(),
        attention_compiled: bool = False,
    ) -> None:
        """Open the connector, register with the coordinator, load this rank's FFN-role
        weights (its EP shard of the routed experts), join the EP group, start the loop.

        `attention_compiled`: the attention engines run torch.compile (not
        `attention.enforce_eager`); the FFN blocks then compute as a compiled vLLM
        engine does (`afd_ray.ffn.model.FFNStack`): gated activations rounded once, and
        the MoE layers that split their output send its parts (the F2A contract,
        `afd_ray.connector.link`).

        Raises:
            ValueError: the checkpoint's architecture has no FFN implementation.
        """
        torch.set_num_threads(ffn.num_threads)
        dtype = getattr(torch, model.dtype)
        device = torch_device(platform)
        channel = FFNChannel(
            connector.host or ray.util.get_node_ip_address(),
            collective_backend(platform),
            connector.timeout_s,
            node=ray.get_runtime_context().get_node_id(),
        )
        self._coordinator = coordinator
        self._checkpoint = resolve_checkpoint(model)
        """Local Hugging Face folder this rank loads its shards from."""
        self._dtype = dtype
        """Model dtype of the loaded FFN tensors (`ModelConfig.dtype`; `load_ffn_stack`)."""
        self._device = device
        """Device of this rank's FFN tensors and EP buffers."""
        self._gate_on_attention = gate_placement == "gate_on_attention"
        """The gates and dense MLPs run on the attention side: the stack holds only the
        MoE layers, without their gate (`FFNStack`)."""
        self._random_weights = model.load_format == "dummy"
        self._quantization = model.quantization
        """`fp8`: the routed experts are quantized at load (`load_ffn_stack`)."""
        self._attention_compiled = attention_compiled
        self._replica = serve.get_replica_context().replica_id.unique_id
        self._address = channel.address
        self.rank = await coordinator.register_ffn.remote(channel.address, self._replica)
        assignment = await coordinator.ep_assignment.remote(self.rank, connector.timeout_s)
        stack = await asyncio.to_thread(self._load_stack, assignment)
        if assignment.epoch > 0 and not assignment.standby:  # started by a scale-out or a recovery
            await coordinator.ffn_loaded.remote(self.rank, assignment.epoch, stack.loaded_bytes)
        ep = await self._ep_group(stack, assignment)
        self._shard = (assignment.ep_rank, assignment.ep_size, assignment.placements)
        self._layouts = {assignment.epoch: assignment.ranks}
        """The FFN ranks in EP order of each layout this rank served or prepares, by epoch."""
        self._placements = {assignment.epoch: assignment.placements}
        """EPLB: the expert placement of each of those layouts (None: contiguous), by epoch."""
        self._preparing = assignment.epoch
        self._standby_at = assignment.epoch if assignment.standby else None
        """The layout epoch this rank stands by under, holding every expert (`ffn.standby_ranks`;
        None: it started in a layout)."""
        self._fenced = False
        """The coordinator removed this rank: it serves nothing and fails its health check."""
        ep_polls = (ffn.ep_idle_check_us / 1e6, ffn.ep_idle_max_check_us / 1e6)  # an MoE rank may join an EP group
        poll_s, idle_poll_s = ep_polls if stack.moe_blocks else (_STOP_POLL_S, _STOP_POLL_S)
        self._runtime = FFNRuntime(
            stack,
            channel,
            dtype,
            poll_s,
            connector.batch_window_us / 1e6,
            ep,
            epoch=assignment.epoch,
            idle_poll_s=idle_poll_s,
            ubatches=ffn.ubatches,
            load_window=ffn.eplb.window_size,
            step_records=observability.step_records,
            ep_lost_wait_s=connector.peer_lost_wait_s,
        )
        self._publisher = FFNPublisher(self.rank) if observability.metrics else None
        self._loop = threading.Thread(
            target=_run_niced, args=(self._runtime,), name=f"afd-ffn-{self.rank}", daemon=True
        )
        self._loop.start()
        self._reporter = asyncio.create_task(self._report())

    def _load_stack(self, assignment: EPAssignment, reuse: FFNStack | None = None) -> FFNStack:
        """This rank's shard for `assignment`; tensors `reuse` holds are copied from it."""
        return load_ffn_stack(
            self._checkpoint,
            self._dtype,
            self._device,
            assignment.ep_rank,
            assignment.ep_size,
            gate_on_attention=self._gate_on_attention,
            reuse=reuse,
            random_weights=self._random_weights,
            attention_compiled=self._attention_compiled,
            quantization=self._quantization,
            placements=layer_placements(assignment.placements),
        )

    async def _ep_group(self, stack: FFNStack, assignment: EPAssignment) -> EPGroup | None:
        """The EP group of `assignment`'s layout (None: one rank, or a dense model);
        returns once every FFN rank of that layout joined."""
        if assignment.ep_size == 1 or not stack.moe_blocks:
            return None
        group = await asyncio.to_thread(_ep_process_group, assignment)
        return EPGroup(group, stack.moe_blocks[0].spec.num_experts, self._device)

    async def _report(self) -> None:
        """Every `_REPORT_PERIOD_S`: report counters and what the loop does (the
        coordinator's heartbeat), and act on its directive; until the coordinator
        fences this rank. A failed report (the coordinator is restarting) is logged
        and the next one tried."""
        while True:
            meter, layout = self._runtime.meter, self._runtime.layout
            stats, expert_tokens, steps = meter.stats, meter.expert_tokens.tolist(), meter.steps.take_new()
            if self._publisher is not None:
                self._publisher.publish(stats, expert_tokens, layout.epoch, steps)
            try:
                directive = await self._coordinator.report_ffn.remote(
                    self.rank,
                    stats,
                    expert_tokens,
                    layout.epoch,
                    layout.take_pause(),
                    steps,
                    self._loop_state(),
                    expert_load=meter.window_load(),
                )
                if directive.fenced:
                    self._fence()
                    return
                if directive.rejoin:  # a restarted coordinator: tell it who this rank is
                    await self._rejoin()
            except Exception:
                logger.warning("FFN rank %d: report to the coordinator failed", self.rank, exc_info=True)
                await asyncio.sleep(_REPORT_PERIOD_S)
                continue
            layout.drop_peers(directive.dead_peers)
            plan = directive.plan
            if plan is not None and plan.epoch > self._preparing:
                self._preparing = plan.epoch
                self._preparation = asyncio.create_task(self._prepare(plan))
                self._preparation.add_done_callback(_log_failure)
            await asyncio.sleep(_REPORT_PERIOD_S)

    def _loop_state(self) -> LoopState:
        if not self._loop.is_alive():
            return LoopState.STOPPED
        return LoopState.EP_LOST if self._runtime.layout.ep_lost else LoopState.SERVING

    def _fence(self) -> None:
        """The coordinator removed this rank: stop the loop (it closes every pair) and
        fail the health checks from now on."""
        logger.warning(
            "FFN rank %d: the coordinator removed it (found dead, or scaled in); it stops serving and "
            "fails its health check",
            self.rank,
        )
        self._fenced = True
        self._runtime.stop()

    async def _rejoin(self) -> None:
        """Re-register with a restarted coordinator: this rank, its address, the
        layout it serves (epoch, its FFN ranks, this rank's EP rank in it), what its
        loop does, and the newest layout epoch it was asked to prepare (the loop kept
        serving meanwhile)."""
        served = self._runtime.layout
        epoch, loop = served.epoch, self._loop_state()
        layout = () if served.left else self._layouts.get(epoch, ())
        state = MemberState.READY if layout else MemberState.STANDBY if epoch == self._standby_at else MemberState.GONE
        member = FFNMember(
            rank=self.rank,
            address=self._address,
            replica=self._replica,
            epoch=epoch,
            state=state if loop is not LoopState.STOPPED else MemberState.GONE,
            ep_rank=layout.index(self.rank) if self.rank in layout else None,
            loop=loop,
        )
        placements = self._placements.get(epoch) if layout else None
        await self._coordinator.rejoin_ffn.remote(member, layout, self._preparing, placements)
        logger.info(
            "FFN rank %d rejoined the coordinator (epoch %d, layout %s, loop %s)", self.rank, epoch, layout, loop.value
        )

    async def _prepare(self, plan: LayoutPlan) -> None:
        """Make before break: build this rank's shard of the layout of `plan` (unless
        it holds it already; dense models never reload), reading from the checkpoint
        only the experts it newly owns, and open its EP group, while the loop keeps
        serving; then hand both to the loop."""
        layout = self._runtime.layout
        assignment = plan.assignment
        self._layouts = {e: ranks for e, ranks in self._layouts.items() if e >= layout.epoch}
        if assignment is None:
            layout.prepare_switch(LayoutSwitch(plan.epoch, layout.model, None, leave=True))
            return
        self._layouts[plan.epoch] = assignment.ranks
        self._placements = {e: p for e, p in self._placements.items() if e >= layout.epoch}
        self._placements[plan.epoch] = assignment.placements
        stack = layout.model
        shard = (assignment.ep_rank, assignment.ep_size, assignment.placements)  # EPLB: a new placement reloads
        if stack.moe_blocks and shard != self._shard:
            stack = await asyncio.to_thread(self._load_stack, assignment, layout.model)
            await self._coordinator.ffn_loaded.remote(self.rank, plan.epoch, stack.loaded_bytes)
        ep = await self._ep_group(stack, assignment)
        self._shard = shard
        layout.prepare_switch(LayoutSwitch(plan.epoch, stack, ep))

    async def param_bytes(self) -> dict[str, int]:
        """Resident parameter bytes of this rank's FFN model, keyed by parameter name
        without layer indices (e.g. `layers.down_proj.weight`)."""
        return resident_bytes(self._runtime.model)

    async def peer_transports(self) -> dict[int, str]:
        """The data plane of each open pair, by attention rank (`shm`, `gloo`, ...)."""
        channel = self._runtime.channel
        transports = {}
        for peer in channel.peers:
            with suppress(KeyError):  # removed by the loop meanwhile
                transports[peer] = channel.transport_of(peer)
        return transports

    async def device_trace(self, path: str, steps: int, delay: int) -> None:
        """Record a profiler trace of this rank's `steps` FFN steps after the next `delay`
        into `path` (Chrome trace JSON; `afd_ray.observability.device_trace`).

        Raises:
            ValueError: `steps` < 1 or `delay` < 0.
        """
        self._runtime.trace.request(Path(path), steps, delay)

    async def device_trace_finish(self, wait_s: float) -> str | None:
        """End the trace `device_trace` asked for (writing what it recorded) and return
        its file once written, within `wait_s` seconds; None: nothing was recorded, or
        the loop did not write it in time."""
        trace = self._runtime.trace
        trace.finish()
        deadline = asyncio.get_running_loop().time() + wait_s
        while trace.pending and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(_STOP_POLL_S / 2)
        return None if trace.written is None else str(trace.written)

    async def check_health(self) -> None:
        """Serve's health check.

        Raises:
            RuntimeError: the coordinator fenced this rank, or the FFN loop thread
                has exited (it failed).
        """
        if self._fenced:
            raise RuntimeError(f"FFN rank {self.rank}: removed by the coordinator; it serves no more")
        if not self._loop.is_alive():
            raise RuntimeError(f"FFN rank {self.rank}: loop thread exited")

    async def __del__(self) -> None:
        """Scale-in (Serve stops this replica): wait until the coordinator moved this
        rank's attention peers and experts to the remaining ranks, then stop the loop.
        When the whole application is being deleted, or the rank was fenced (it
        serves nothing), just stop."""
        if hasattr(self, "_runtime"):
            try:
                if not self._fenced and not await app_deleting(serve.get_replica_context().app_name):
                    await self._coordinator.ffn_leaving.remote(self.rank)
            finally:
                self._runtime.stop()
                await asyncio.to_thread(self._loop.join, _STOP_POLL_S * 20)


def _log_failure(task: asyncio.Task) -> None:
    """Log why preparing a layout failed (the coordinator's resize then times out with
    an error in its event)."""
    if not task.cancelled() and task.exception() is not None:
        logger.error("FFN layout preparation failed", exc_info=task.exception())


def _run_niced(runtime: FFNRuntime) -> None:
    """The FFN compute loop's thread: `runtime.run()` below the control plane's priority."""
    lower_data_plane_priority()
    runtime.run()
