"""Membership records exchanged through the coordinator (JSON-serializable)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from afd_ray.autoscale.policy import MetricsSnapshot
from afd_ray.connector.channel import FFNAddress

__all__ = ["AFDStatus", "AttentionAssignment", "AttentionMember", "EPAssignment", "FFNMember"]


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class AttentionAssignment(_Record):
    """What an attention rank needs to open its pair channel to its FFN peer."""

    peer: int
    """This attention rank's id."""
    ffn_rank: int
    host: str
    store_port: int
    control_port: int
    epoch: int
    backend: str
    """Collective backend of the pair group: gloo | nccl | hccl."""
    timeout_s: float
    """Bound on rendezvous and on every receive, seconds."""

    @property
    def address(self) -> FFNAddress:
        return FFNAddress(self.host, self.store_port, self.control_port)


class EPAssignment(_Record):
    """An FFN rank's place in the FFN pool's EP group; FFN rank 0's store hosts the
    group's rendezvous."""

    ep_rank: int
    ep_size: int
    host: str
    store_port: int
    epoch: int
    backend: str
    timeout_s: float


class FFNMember(_Record):
    """One FFN rank as `/afd/status` shows it."""

    rank: int
    address: FFNAddress
    steps: int = 0
    layers: int = 0
    tokens: int = 0
    busy_s: float = 0.0
    a2f_bytes: int = 0
    f2a_bytes: int = 0
    expert_tokens: list[int] = []
    """Rows this rank's tokens routed to each expert, summed over MoE layers and steps;
    divided by `steps` x MoE layers it is tokens per expert per step (expert load)."""


class AttentionMember(_Record):
    """One attention rank as `/afd/status` shows it."""

    rank: int
    ffn_peer: int


class AFDStatus(_Record):
    """Body of `GET /afd/status`."""

    epoch: int
    attention: list[AttentionMember]
    ffn: list[FFNMember]
    metrics: MetricsSnapshot | None = None
    """The autoscaling signals over the coordinator's sliding window (None where no
    coordinator computed them)."""
