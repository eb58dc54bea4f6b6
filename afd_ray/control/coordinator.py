"""The coordinator: ranks, FFN peers, the epoch and the status of both pools.

A single-replica Serve deployment. Pool members call it only at start-up and to
report counters; nothing on the data path goes through it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict

from afd_ray.autoscale.policy import MetricsSnapshot
from afd_ray.autoscale.signals import AttentionReport, SignalAggregator
from afd_ray.config import ConnectorConfig, Platform
from afd_ray.connector.channel import FFNAddress
from afd_ray.control.membership import (
    AFDStatus,
    AttentionAssignment,
    AttentionMember,
    EPAssignment,
    FFNMember,
)
from afd_ray.ffn.runtime import FFNStats
from afd_ray.platform import collective_backend

__all__ = ["Coordinator"]


class Coordinator:
    """Hands out ranks and FFN peers; keeps what `/afd/status` shows.

    Peer assignment is balanced: a new attention rank gets the FFN rank with the
    fewest attention peers (lowest rank on ties), so A attention ranks over F FFN
    ranks give each FFN rank floor(A/F) or ceil(A/F) peers.
    """

    def __init__(self, platform: Platform, connector: ConnectorConfig, ffn_ranks: int) -> None:
        self._ffn_ranks = ffn_ranks
        self._backend = collective_backend(platform)
        self._timeout_s = connector.timeout_s
        self._epoch = 0
        self._ffn: dict[int, FFNMember] = {}
        self._attention: dict[int, AttentionMember] = {}
        self._ffn_joined = asyncio.Condition()
        self._signals = SignalAggregator()

    async def register_ffn(self, address: FFNAddress) -> int:
        """Add an FFN rank serving at `address`; returns its rank."""
        rank = len(self._ffn)
        self._ffn[rank] = FFNMember(rank=rank, address=address)
        async with self._ffn_joined:
            self._ffn_joined.notify_all()
        return rank

    async def ep_assignment(self, rank: int, wait_s: float) -> EPAssignment:
        """FFN rank `rank`'s EP rank and group rendezvous, once all `ffn.num_ranks`
        FFN ranks registered.

        Raises:
            TimeoutError: the FFN pool was not complete within `wait_s` seconds.
        """
        await self._ffn_pool_complete(wait_s)
        host = self._ffn[0].address
        return EPAssignment(
            ep_rank=rank, ep_size=self._ffn_ranks, host=host.host, store_port=host.store_port,
            epoch=self._epoch, backend=self._backend, timeout_s=self._timeout_s,
        )

    async def report_ffn(self, rank: int, stats: FFNStats, expert_tokens: list[int]) -> None:
        """Replace the counters and expert load of FFN rank `rank`; feed its counters
        to the autoscaling signals."""
        self._ffn[rank] = self._ffn[rank].model_copy(update=asdict(stats) | {"expert_tokens": expert_tokens})
        self._signals.report_ffn(rank, stats, time.time())

    async def report_attention(self, rank: int, report: AttentionReport) -> None:
        """Add attention rank `rank`'s autoscaling signals since its previous report."""
        self._signals.report_attention(rank, report, time.time())

    async def metrics(self) -> MetricsSnapshot:
        """The autoscaling signals of the current members over the last
        `SignalAggregator.window_s` seconds."""
        return self._signals.snapshot(time.time(), self._attention, self._ffn)

    async def assign_attention(self, wait_s: float) -> AttentionAssignment:
        """A new attention rank id and its FFN peer, once the FFN pool is complete.

        Raises:
            TimeoutError: the FFN pool was not complete within `wait_s` seconds.
        """
        await self._ffn_pool_complete(wait_s)
        load = {rank: 0 for rank in self._ffn}
        for member in self._attention.values():
            load[member.ffn_peer] += 1
        ffn_rank = min(load, key=lambda rank: (load[rank], rank))
        peer = len(self._attention)
        self._attention[peer] = AttentionMember(rank=peer, ffn_peer=ffn_rank)
        address = self._ffn[ffn_rank].address
        return AttentionAssignment(
            peer=peer, ffn_rank=ffn_rank, host=address.host, store_port=address.store_port,
            control_port=address.control_port, epoch=self._epoch, backend=self._backend,
            timeout_s=self._timeout_s,
        )

    async def _ffn_pool_complete(self, wait_s: float) -> None:
        async with self._ffn_joined:
            await asyncio.wait_for(
                self._ffn_joined.wait_for(lambda: len(self._ffn) >= self._ffn_ranks), wait_s
            )

    async def status(self) -> AFDStatus:
        """Epoch, every attention rank with its FFN peer, every FFN rank with counters."""
        return AFDStatus(
            epoch=self._epoch,
            attention=[self._attention[r] for r in sorted(self._attention)],
            ffn=[self._ffn[r] for r in sorted(self._ffn)],
            metrics=await self.metrics(),
        )
