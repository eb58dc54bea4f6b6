"""The attention side's FFN client: one per vLLM worker process.

The runtime, not the model, owns the connector. The AttentionServer puts its
`AttentionAssignment` into the environment variable `AFD_RAY_ASSIGNMENT` before it
starts the vLLM engine; the engine's worker process inherits it, and the first call of
the `afd_ray::remote_ffn` op (or `afd_connect`) opens the pair link from it. vLLM's
own profile and warm-up forwards therefore already run through the FFN peer.

The client uses only the connector contract (`afd_ray.connector.link.AttentionLink`);
`AttentionChannel` opens the transport the assignment names.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch

from afd_ray.connector.channel import AttentionChannel
from afd_ray.connector.header import StepHeader
from afd_ray.connector.link import AttentionLink
from afd_ray.control.membership import AttentionAssignment
from afd_ray.observability.steps import AttentionStep, StepRing

__all__ = [
    "ASSIGNMENT_ENV", "FFNClient", "ffn_client", "record_steps", "repeer_ffn_client", "reset_ffn_client",
    "take_steps",
]

ASSIGNMENT_ENV = "AFD_RAY_ASSIGNMENT"

_client: FFNClient | None = None

_steps: StepRing[AttentionStep] = StepRing(4096)
"""This process's last attention steps (timing records, `afd_ray.observability.steps`);
they outlive a re-peering."""

_batch: Callable[[], list[str]] = list
"""The engine request ids of the batch being run (`record_steps`)."""


def record_steps(capacity: int, request_ids: Callable[[], list[str]]) -> None:
    """Keep the last `capacity` steps' timing records (0: record none), each naming
    the requests `request_ids()` gives when it starts (the vLLM worker's batch)."""
    global _steps, _batch
    _steps, _batch = StepRing(capacity), request_ids


def take_steps() -> list[AttentionStep]:
    """The step records finished since the previous call, oldest first."""
    return _steps.take_new()


class FFNClient:
    """Sends each layer's hidden states to the FFN peer and returns its output.

    The model announces every forward pass with `begin_step` (the STEP header) before
    its first FFN layer; `exchange` then runs one layer's A2F + F2A. Each pass leaves
    an `AttentionStep` in this process's step ring (`take_steps`) once the next one
    begins: its header and the time blocked in `exchange`, summed over layers.
    """

    def __init__(self, assignment: AttentionAssignment) -> None:
        self.assignment = assignment
        self.link: AttentionLink = AttentionChannel(
            assignment.address, assignment.peer, assignment.epoch,
            assignment.transport, assignment.timeout_s,
        )
        self._step_tokens = 0
        """Rows T of the step announced last (0 before the first)."""
        self._header: StepHeader | None = None
        self._start_s = 0.0
        self._requests: tuple[str, ...] = ()
        self._exchange_s = 0.0

    def begin_step(self, num_tokens: int) -> None:
        """Send the STEP header of a forward pass of `num_tokens` rows."""
        if _steps.capacity > 0:
            self._record()
            self._start_s, self._requests, self._exchange_s = time.time(), tuple(_batch()), 0.0
        self._header = self.link.send_header(num_tokens)
        self._step_tokens = num_tokens

    def exchange(
        self, hidden: torch.Tensor, layer: int, topk: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """A2F + F2A of decoder layer `layer`: hidden `[T, H]` (plus, with
        `gate_on_attention`, its top-k ids `[T, k]` int64 and weights `[T, k]`
        float32) -> FFN output `[T, H]`.

        Raises:
            ValueError: T differs from the step announced by `begin_step`.
            PeerLostError: the FFN peer is gone.
        """
        if hidden.shape[0] != self._step_tokens:
            raise ValueError(
                f"layer {layer}: {hidden.shape[0]} rows in a step announced with {self._step_tokens}"
            )
        if _steps.capacity == 0:
            return self.link.exchange(hidden, topk)
        start = time.perf_counter()
        out = self.link.exchange(hidden, topk)
        self._exchange_s += time.perf_counter() - start
        return out

    def _record(self) -> None:
        """Keep the finished step's timing record."""
        header = self._header
        if header is not None:
            _steps.append(AttentionStep(
                header.peer, header.epoch, header.step_id, self._start_s, header.num_tokens, self._exchange_s,
                self._requests,
            ))  # fmt: skip


def ffn_client() -> FFNClient:
    """This process's client, opened on first use from `AFD_RAY_ASSIGNMENT`.

    Raises:
        RuntimeError: the variable is unset (the AFD model runs outside an AttentionServer).
    """
    global _client
    if _client is None:
        raw = os.environ.get(ASSIGNMENT_ENV)
        if raw is None:
            raise RuntimeError(f"{ASSIGNMENT_ENV} is unset: AFD models run only inside an AttentionServer")
        _client = FFNClient(AttentionAssignment.model_validate_json(raw))
    return _client


def reset_ffn_client() -> None:
    """Close this process's client, if open, and forget it; the next `ffn_client()`
    opens a new one from the then-current `AFD_RAY_ASSIGNMENT`.

    For processes that run several AFD engines one after another in-process
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, as tests do): each engine needs the channel
    of its own FFN peer, not the cached one of the previous engine.
    """
    global _client
    if _client is not None:
        _client._record()
        _client.link.close()
        _client = None


def repeer_ffn_client(assignment: AttentionAssignment) -> None:
    """Move this process's client to the FFN peer of `assignment`: close the old pair
    (LEAVE), then open the new one (JOIN under `assignment.epoch`; blocks until the new
    FFN peer admits it at its next step boundary). Call between two forward passes.

    Raises:
        RuntimeError / DistStoreError: the new peer did not admit it within the timeout.
    """
    global _client
    reset_ffn_client()
    os.environ[ASSIGNMENT_ENV] = assignment.model_dump_json()
    _client = FFNClient(assignment)
