"""The membership protocol of one attention rank: what it tells the coordinator and
what it takes from it.

An `AttentionServer` holds one `Member`. `Member.join` registers the rank (STARTING)
and gets its first FFN peer; `Member.serve` reports it READY once its engine serves,
then every `_REPORT_PERIOD_S` sends the coordinator its autoscaling signals and step
records, and every `_WATCH_PERIOD_S` polls it: when the coordinator moved the rank to
another FFN peer, the worker re-peers between two engine steps
(`AFDWorkerExtension.afd_repeer`); once it marks the rank DRAINING, `draining` is set,
and `drained` `autoscale.drain_timeout_s` later (running requests then end with an
error). A restarted coordinator that does not know the rank is told who it is
(`rejoin_attention`). `Member.leave` closes the pair channel (LEAVE, then GONE);
`Member.abandon` tells the coordinator the rank's engine failed to start (GONE).

The rescue endpoint: a worker whose FFN peer died inside a forward pass cannot be
reached through the engine (it is blocked in that pass), and runs in vLLM's EngineCore
process, not in this one; it asks this rank over a ZeroMQ REQ/REP pair on the
loopback (`FFNClient._resume`), and `_serve_rescue` answers it with the next
assignment the coordinator gives.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import ray
import zmq
import zmq.asyncio
from ray import serve
from ray.serve.handle import DeploymentHandle
from vllm.v1.engine.async_llm import AsyncLLM

from afd_ray.compat import num_unfinished_requests
from afd_ray.config import AutoscaleConfig, ConnectorConfig
from afd_ray.control.membership import AttentionAssignment, AttentionDirective, AttentionMember, MemberState
from afd_ray.control.serve_api import app_deleting
from afd_ray.observability.publish import AttentionPublisher
from afd_ray.observability.recorder import AttentionRecorder
from afd_ray.observability.steps import AttentionStep

__all__ = ["Member", "next_assignment"]

logger = logging.getLogger(__name__)

_REPORT_PERIOD_S = 1.0
"""How often an attention rank sends its autoscaling signals to the coordinator."""
_WATCH_PERIOD_S = 0.5
"""How often an attention rank asks the coordinator for its state and FFN peer."""
_ABANDON_WAIT_S = 5.0
"""Longest wait of a rank whose engine failed to start for the coordinator to take
note (`Member.abandon`), seconds."""


class Member:
    """One attention rank's membership in the pools (see the module docstring)."""

    def __init__(
        self,
        coordinator: DeploymentHandle,
        rescue: zmq.asyncio.Socket,
        assignment: AttentionAssignment,
        replica: str,
        node: str,
        drain_timeout_s: float,
    ) -> None:
        """Use `Member.join`."""
        self._coordinator = coordinator
        self._rescue = rescue
        self.assignment = assignment
        """The FFN peer the worker holds now, with this rank's rescue endpoint."""
        self._replica, self._node = replica, node
        self._drain_timeout_s = drain_timeout_s
        self.draining = asyncio.Event()
        """Set once the coordinator marked this rank DRAINING."""
        self.drained = asyncio.Event()
        """Set `autoscale.drain_timeout_s` after draining began: running requests end with an error."""
        self._tasks = [asyncio.create_task(self._serve_rescue())]

    @classmethod
    async def join(
        cls, coordinator: DeploymentHandle, connector: ConnectorConfig, autoscale: AutoscaleConfig
    ) -> Member:
        """Register this replica with the coordinator and get its first FFN peer
        (`assignment`); open the rescue endpoint.

        Raises:
            TimeoutError: the FFN layout did not serve within `autoscale.resize_timeout_s`.
        """
        replica = serve.get_replica_context().replica_id.unique_id
        node = ray.get_runtime_context().get_node_id()
        rescue = zmq.asyncio.Context.instance().socket(zmq.REP)
        rescue.setsockopt(zmq.LINGER, 0)
        port = rescue.bind_to_random_port("tcp://127.0.0.1")
        rescue_fields = {"rescue": f"tcp://127.0.0.1:{port}", "peer_lost_wait_s": connector.peer_lost_wait_s}
        first = await coordinator.assign_attention.remote(autoscale.resize_timeout_s, replica, node)
        assignment = first.model_copy(update=rescue_fields)
        return cls(coordinator, rescue, assignment, replica, node, autoscale.drain_timeout_s)

    @property
    def rank(self) -> int:
        """This attention rank's id."""
        return self.assignment.peer

    async def serve(
        self, engine: AsyncLLM, recorder: AttentionRecorder, publisher: AttentionPublisher | None, step_records: int
    ) -> None:
        """Check the worker's pair channel (`afd_connect`, keeping `step_records` step
        records), report READY, then report and poll the coordinator until `leave`."""
        await engine.collective_rpc("afd_connect", args=(step_records,))
        await self._coordinator.attention_ready.remote(self.rank)
        self._tasks.append(asyncio.create_task(self._report(engine, recorder, publisher)))
        self._tasks.append(asyncio.create_task(self._watch(engine)))

    async def leave(self, engine: AsyncLLM) -> None:
        """Serve stops this replica after draining it: tell the coordinator (unless the
        whole application is being deleted), end running requests (`drained`), close
        the worker's pair channel to the FFN peer (LEAVE, between engine steps), report
        GONE."""
        deleting = await app_deleting(serve.get_replica_context().app_name)
        if not deleting:
            await self._coordinator.attention_leaving.remote(self.rank)
        self.drained.set()
        await engine.collective_rpc("afd_close")
        if not deleting:
            await self._coordinator.attention_gone.remote(self.rank)

    async def abandon(self) -> None:
        """This rank's engine did not start: tell the coordinator the rank is gone
        (`attention_failed`), waiting at most `_ABANDON_WAIT_S`; best effort, since a
        coordinator that does not answer retires the rank once Serve removed its
        replica (`Resizer.watch_replicas`). Then close the rescue endpoint."""
        try:
            await asyncio.wait_for(self._coordinator.attention_failed.remote(self.rank), _ABANDON_WAIT_S)
        except Exception:  # noqa: BLE001 - logged; the coordinator's replica watch retires the rank
            logger.warning("attention rank %d: telling the coordinator of its failed start failed", self.rank)
        finally:
            for task in self._tasks:
                task.cancel()
            self.close()

    def close(self) -> None:
        """Close the rescue endpoint."""
        self._rescue.close()

    async def _report(
        self, engine: AsyncLLM, recorder: AttentionRecorder, publisher: AttentionPublisher | None
    ) -> None:
        """Every `_REPORT_PERIOD_S`: send the coordinator this rank's autoscaling
        signals and the worker's new step records, and export their metrics."""
        while True:
            await asyncio.sleep(_REPORT_PERIOD_S)
            (records,) = await engine.collective_rpc("afd_take_steps")
            steps = [AttentionStep(**{**r, "requests": tuple(r["requests"])}) for r in records]
            report = recorder.drain(num_unfinished_requests(engine))
            if publisher is not None:
                publisher.publish(steps)
            try:
                await self._coordinator.report_attention.remote(self.rank, report, steps)
            except Exception:  # the coordinator is restarting: the next report goes through
                logger.warning("attention rank %d: report to the coordinator failed", self.rank, exc_info=True)

    async def _watch(self, engine: AsyncLLM) -> None:
        """Follow the coordinator: re-peer when it moved this rank to another FFN
        peer; once DRAINING, end the requests still running after the drain timeout."""
        while True:
            await asyncio.sleep(_WATCH_PERIOD_S)
            try:
                directive = await self._coordinator.attention_poll.remote(self.rank)
                if directive is None:  # a restarted coordinator: tell it who this rank is
                    await self._rejoin()
                    continue
            except Exception:  # the coordinator is restarting: poll again
                logger.warning("attention rank %d: poll of the coordinator failed", self.rank, exc_info=True)
                continue
            assignment = directive.assignment
            if assignment is not None and assignment.epoch > self.assignment.epoch:
                try:
                    await self._repeer(engine, assignment)
                except Exception:  # logged; the next poll retries
                    logger.exception("attention rank %d: re-peering failed", self.rank)
            if directive.state is MemberState.DRAINING and not self.draining.is_set():
                self.draining.set()
                logger.info("attention rank %d draining for up to %.0f s", self.rank, self._drain_timeout_s)
                asyncio.get_running_loop().call_later(self._drain_timeout_s, self.drained.set)

    async def _rejoin(self) -> None:
        """Re-register with a restarted coordinator: this rank, its FFN peer and
        pairing epoch, and whether it drains."""
        state = MemberState.DRAINING if self.draining.is_set() else MemberState.READY
        epoch = self.assignment.epoch
        member = AttentionMember(
            rank=self.rank,
            ffn_peer=self.assignment.ffn_rank,
            state=state,
            epoch=epoch,
            replica=self._replica,
            node=self._node,
            peered_epoch=epoch,
        )
        await self._coordinator.rejoin_attention.remote(member)
        logger.info("attention rank %d rejoined the coordinator", self.rank)

    def _with_rescue(self, assignment: AttentionAssignment) -> AttentionAssignment:
        """`assignment` with this rank's rescue endpoint and bound, for the worker."""
        held = self.assignment
        return assignment.model_copy(update={"rescue": held.rescue, "peer_lost_wait_s": held.peer_lost_wait_s})

    async def _serve_rescue(self) -> None:
        """Forever: answer the worker whose FFN peer died inside a forward pass (it
        sends the assignment it held) with the next one, once the coordinator moved
        this rank to a live FFN peer (a newer epoch). The engine is blocked in that
        pass meanwhile, so this runs beside `_watch`, not through the engine.

        Each answer waits at most the worker's own bound, `peer_lost_wait_s`
        (`next_assignment`); past it the worker has given up (that pass fails with
        PeerLostError), and the reply is the held assignment, which only returns the
        REP socket to receiving."""
        while True:
            held = AttentionAssignment.model_validate_json(await self._rescue.recv_string())
            poll = self._coordinator.attention_poll.remote
            new = await next_assignment(lambda: poll(self.rank), held, _WATCH_PERIOD_S / 2)
            if new is None:
                logger.warning(
                    "attention rank %d: no FFN peer after %d within %.0f s (connector.peer_lost_wait_s)",
                    self.rank,
                    held.ffn_rank,
                    held.peer_lost_wait_s,
                )
                await self._rescue.send_string(held.model_dump_json())
                continue
            assignment = self._with_rescue(new)
            self.assignment = assignment  # `_watch` must not re-peer the engine once more
            await self._rescue.send_string(assignment.model_dump_json())
            await self._coordinator.attention_peered.remote(self.rank, assignment.epoch)
            logger.warning(
                "attention rank %d: lost FFN peer %d mid-pass (it died, or its EP group failed); its worker moves "
                "to FFN peer %d (epoch %d)",
                self.rank,
                held.ffn_rank,
                assignment.ffn_rank,
                assignment.epoch,
            )

    async def _repeer(self, engine: AsyncLLM, assignment: AttentionAssignment) -> None:
        """Close the pair with the old FFN peer (LEAVE) and join the new one, between
        two engine steps of the worker."""
        old = self.assignment
        assignment = self._with_rescue(assignment)
        await engine.collective_rpc("afd_repeer", args=(assignment.model_dump_json(),))
        self.assignment = assignment
        await self._coordinator.attention_peered.remote(self.rank, assignment.epoch)
        logger.info(
            "attention rank %d: FFN peer %d (epoch %d) -> %d (epoch %d)",
            self.rank,
            old.ffn_rank,
            old.epoch,
            assignment.ffn_rank,
            assignment.epoch,
        )


async def next_assignment(
    poll: Callable[[], Awaitable[AttentionDirective | None]], held: AttentionAssignment, period_s: float
) -> AttentionAssignment | None:
    """The assignment after `held` (a newer epoch), polling the coordinator's
    directive for this rank (`poll`, e.g. `Coordinator.attention_poll`) every
    `period_s` seconds; None once `held.peer_lost_wait_s` seconds passed without
    one. A poll that raises (the coordinator is restarting) or returns None (it
    does not know the rank yet) counts as no new assignment."""
    deadline = time.monotonic() + held.peer_lost_wait_s
    while True:
        try:
            directive = await poll()
        except Exception:  # noqa: BLE001 - the coordinator is restarting; ask again
            directive = None
        if directive is not None and directive.assignment is not None and directive.assignment.epoch > held.epoch:
            return directive.assignment
        if time.monotonic() + period_s > deadline:
            return None
        await asyncio.sleep(period_s)
