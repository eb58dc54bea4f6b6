"""The control plane between an attention rank and its FFN peer: where the FFN rank
is reached (`FFNAddress`), and the messages it reads there (`StepHeader`).

The control plane carries only these fixed-size headers (40 bytes); the data plane
carries only tensors, in an order both sides derive from the header. No torch and no
ZeroMQ: the membership records (`afd_ray.control.membership`) carry the address.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

__all__ = ["FFNAddress", "HeaderKind", "StepHeader"]

_WIRE = struct.Struct("<4q2i")


@dataclass(frozen=True)
class FFNAddress:
    """Where attention peers reach one FFN rank (published through the coordinator)."""

    host: str
    store_port: int
    """Port of the FFN rank's `TCPStore` (pair rendezvous)."""
    control_port: int
    """Port of the FFN rank's header socket."""
    node: str = ""
    """Ray node id of the FFN rank ("" outside Ray); `auto` picks a same-node
    transport for attention peers on the same node."""


class HeaderKind(IntEnum):
    """What a header announces to the FFN rank."""

    JOIN = 1
    """The attention rank opens its pair channel; the FFN admits it at a step boundary."""
    STEP = 2
    """The attention rank starts a forward step: per FFN layer, `num_tokens` rows follow."""
    LEAVE = 3
    """The attention rank detaches; no further tensors follow."""


@dataclass(frozen=True, slots=True)
class StepHeader:
    """One control message from attention rank `peer`.

    Attributes:
        kind: what the message announces.
        peer: the attention rank id (unique within the application).
        epoch: membership epoch the sender believes in; the FFN drops a message whose
            epoch differs from its own, it never applies it.
        step_id: per-peer step counter, +1 per STEP (0 for JOIN/LEAVE).
        num_tokens: rows T of every A2F/F2A tensor `[T, H]` of this step.
        first_layer: the step's first FFN layer; the layers from it to the last
            follow (not 0 only when a step is resumed on a new FFN peer).
    """

    kind: HeaderKind
    peer: int
    epoch: int
    step_id: int = 0
    num_tokens: int = 0
    first_layer: int = 0

    def pack(self) -> bytes:
        """Serialize to 40 little-endian bytes (four int64, then two int32)."""
        return _WIRE.pack(self.kind, self.peer, self.epoch, self.step_id, self.num_tokens, self.first_layer)

    @classmethod
    def unpack(cls, buf: bytes) -> StepHeader:
        """Inverse of `pack`.

        Raises:
            ValueError: `buf` is not a header (wrong size or unknown kind).
        """
        if len(buf) != _WIRE.size:
            raise ValueError(f"step header must be {_WIRE.size} bytes, got {len(buf)}")
        kind, peer, epoch, step_id, num_tokens, first_layer = _WIRE.unpack(buf)
        return cls(HeaderKind(kind), peer, epoch, step_id, num_tokens, first_layer)
