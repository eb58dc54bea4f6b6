"""Which transport carries the data plane of an attention↔FFN pair, and which ones a
collective backend allows (no torch: `afd_ray.config` validates with it).

The transports themselves: `afd_ray.connector.shm`, `afd_ray.connector.group_pair`
(`gloo`, `nccl`, `hccl`) and `afd_ray.connector.cuda_ipc`; the contract they
implement: `afd_ray.connector.link`.
"""

from __future__ import annotations

from typing import Literal

from afd_ray.platform import Backend

__all__ = ["Transport", "TransportChoice", "check_transport", "select_transport"]

Transport = Literal["shm", "gloo", "nccl", "hccl", "cuda_ipc"]
"""How the data plane of one pair moves tensors."""
TransportChoice = Literal["auto", "shm", "gloo", "nccl", "hccl", "cuda_ipc"]
"""`ConnectorConfig.transport`: a transport, or `auto` (picked per pair)."""

_SAME_NODE: dict[Backend, Transport] = {"gloo": "shm", "nccl": "cuda_ipc", "hccl": "hccl"}
"""Transport `auto` picks for a pair on one Ray node, by collective backend."""
_ALLOWED: dict[Backend, frozenset[str]] = {
    "gloo": frozenset({"shm", "gloo"}),
    "nccl": frozenset({"nccl", "cuda_ipc"}),
    "hccl": frozenset({"hccl"}),
}


def select_transport(choice: TransportChoice, backend: Backend, same_node: bool) -> Transport:
    """The data plane of one pair.

    Args:
        choice: `ConnectorConfig.transport`.
        backend: the platform's collective backend (`gloo` | `nccl` | `hccl`).
        same_node: both members of the pair run on one Ray node.

    Returns:
        `choice` unless it is `auto`; `auto` gives the same-node transport of the
        backend (`shm` for CPU) on one node, else the backend itself.

    Raises:
        ValueError: `choice` cannot carry the backend's tensors (e.g. `shm` on CUDA),
            naming the field.
    """
    if backend not in _ALLOWED:
        raise ValueError(f"connector backend: unknown {backend!r}; expected gloo, nccl or hccl")
    if choice == "auto":
        return _SAME_NODE[backend] if same_node else backend  # type: ignore[return-value]
    check_transport(choice, backend)
    return choice


def check_transport(transport: str, backend: Backend, field: str | None = "connector.transport") -> None:
    """Raise ValueError unless `transport` carries the tensors of `backend`'s device;
    the message starts with `field` (None: a pydantic field validator's error already
    names its field)."""
    allowed = sorted(_ALLOWED.get(backend, ()))
    if transport not in allowed:
        named = "" if field is None else f"{field}: "
        raise ValueError(f"{named}{transport!r} cannot carry {backend} tensors; use auto or one of {allowed}")
