"""The attention side's FFN client: one per vLLM worker process.

The runtime, not the model, owns the connector. The AttentionServer puts its
`AttentionAssignment` into the environment variable `AFD_RAY_ASSIGNMENT` before it
starts the vLLM engine; the engine's worker process inherits it, and the first call of
the `afd_ray::remote_ffn_out` op (or `afd_connect`) opens the pair link from it. vLLM's
own profile and warm-up forwards therefore already run through the FFN peer.

The client uses only the connector contract (`afd_ray.connector.link.AttentionLink`);
`AttentionChannel` opens the transport the assignment names.

An FFN peer that dies inside a forward pass costs a pause, not the pass (docs/failures.md):
on `PeerLostError` the client asks its `AttentionServer` (over the assignment's
`rescue` endpoint) for the new peer the coordinator assigns once it re-formed the FFN
layout, joins it, announces the rest of the step (`first_layer` = the current layer)
and repeats the current layer's exchange. The FFN side holds no request state, so the
result is the same; vLLM never sees an error. Past `peer_lost_wait_s` the error is
raised (the engine fails; its requests end with an explicit error).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch
import zmq

from afd_ray.connector.channel import AttentionChannel
from afd_ray.connector.header import StepHeader
from afd_ray.connector.link import AttentionLink, PeerLostError
from afd_ray.control.membership import AttentionAssignment
from afd_ray.observability.steps import AttentionStep, StepRing

__all__ = [
    "ASSIGNMENT_ENV", "FFNClient", "capturing", "ffn_client", "record_steps", "repeer_ffn_client", "reset_ffn_client",
    "take_steps",
]

ASSIGNMENT_ENV = "AFD_RAY_ASSIGNMENT"

logger = logging.getLogger(__name__)

_client: FFNClient | None = None

_CAPTURABLE = ("cuda_ipc",)
"""Transports whose exchange is queued on the current CUDA stream with device-side
waits only, so that a CUDA graph can hold it (`afd_ray.connector.cuda_ipc`)."""

_steps: StepRing[AttentionStep] = StepRing(4096)
"""This process's last attention steps (timing records, `afd_ray.observability.steps`);
they outlive a re-peering."""

_batch: Callable[[], list[str]] = list
"""The engine request ids of the batch being run (`record_steps`)."""


def capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a CUDA graph (False without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


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

    A whole-step CUDA graph (`attention.cudagraph_mode: full_decode`): while it is
    captured, `exchange` only queues the link's device work (no header was sent, no
    time is taken, a lost peer cannot be resumed: the transport must be one whose
    calls are queued on the stream, `cuda_ipc`); its replays are announced with
    `begin_step(T, replayed=True)` and run no host code per layer, so their step
    records have `exchange_s` 0. A dead FFN peer then stops the replay at the
    transport's device-side wait: `cuda_ipc` traps after `connector.timeout_s`, which
    ends the engine's CUDA context (the engine fails, Serve replaces the replica).
    """

    def __init__(self, assignment: AttentionAssignment) -> None:
        self.assignment = assignment
        self.link: AttentionLink = _open(assignment)
        self._step_tokens = 0
        """Rows T of the step announced last (0 before the first)."""
        self._header: StepHeader | None = None
        self._start_s = 0.0
        self._requests: tuple[str, ...] = ()
        self._exchange_s = 0.0
        self._replayed = False
        self.resumes = 0
        """Forward passes continued on a new FFN peer after the old one died."""
        self.replays = 0
        """Forward passes announced as whole-step graph replays (`begin_step(replayed=True)`)."""

    def begin_step(self, num_tokens: int, replayed: bool = False) -> None:
        """Send the STEP header of a forward pass of `num_tokens` rows; `replayed`: a
        captured whole-step graph runs it (counted in `replays`)."""
        self.replays += replayed
        if _steps.capacity > 0:
            self._record()
            self._start_s, self._requests, self._exchange_s = time.time(), tuple(_batch()), 0.0
            self._replayed = replayed
        self._header = self.link.send_header(num_tokens)
        self._step_tokens = num_tokens

    def exchange(
        self,
        hidden: torch.Tensor,
        layer: int,
        topk: tuple[torch.Tensor, torch.Tensor] | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A2F + F2A of decoder layer `layer`: hidden `[T, H]` (plus, with
        `gate_on_attention`, its top-k ids `[T, k]` int64 and weights `[T, k]`
        float32) -> FFN output `[T, H]`, written into `out` (contiguous, `hidden`'s
        shape and dtype) when given, else into a new tensor.

        Raises:
            ValueError: T differs from the step announced by `begin_step`, or a CUDA
                graph is captured over a transport that cannot be.
            PeerLostError: the FFN peer is gone.
        """
        if capturing():
            return self._captured(hidden, topk, out)
        if hidden.shape[0] != self._step_tokens:
            raise ValueError(
                f"layer {layer}: {hidden.shape[0]} rows in a step announced with {self._step_tokens}"
            )
        if _steps.capacity == 0:
            return self._exchange(hidden, layer, topk, out)
        start = time.perf_counter()
        out = self._exchange(hidden, layer, topk, out)
        self._exchange_s += time.perf_counter() - start
        return out

    def _captured(
        self, hidden: torch.Tensor, topk: tuple[torch.Tensor, torch.Tensor] | None, out: torch.Tensor | None
    ) -> torch.Tensor:
        """The exchange of a whole-step graph being captured: the link's device work only."""
        if self.link.transport not in _CAPTURABLE:
            raise ValueError(
                f"attention.cudagraph_mode full_decode needs a transport whose exchange is device work "
                f"({', '.join(_CAPTURABLE)}); the pair uses {self.link.transport!r} (connector.transport)"
            )
        return self.link.exchange(hidden, topk, out)

    def _exchange(
        self,
        hidden: torch.Tensor,
        layer: int,
        topk: tuple[torch.Tensor, torch.Tensor] | None,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """One layer's exchange; on a lost peer, `_resume` when a rescue endpoint is set."""
        try:
            return self.link.exchange(hidden, topk, out)
        except PeerLostError as lost:
            if not self.assignment.rescue:
                raise
            return self._resume(hidden, layer, topk, out, lost)

    def _record(self) -> None:
        """Keep the finished step's timing record."""
        header = self._header
        if header is not None:
            _steps.append(AttentionStep(
                header.peer, header.epoch, header.step_id, self._start_s, header.num_tokens, self._exchange_s,
                self._requests, self._replayed,
            ))  # fmt: skip

    def _resume(
        self,
        hidden: torch.Tensor,
        layer: int,
        topk: tuple[torch.Tensor, torch.Tensor] | None,
        out: torch.Tensor | None,
        lost: PeerLostError,
    ) -> torch.Tensor:
        """Repeat layer `layer`'s exchange on the new FFN peer the coordinator assigns
        (the rest of the step announced from `layer` on), within `peer_lost_wait_s`.

        Raises:
            PeerLostError: no new peer answered within `peer_lost_wait_s`.
        """
        logger.warning("FFN peer %d lost at layer %d (%s); waiting for a new peer", self.assignment.ffn_rank,
                       layer, lost)  # fmt: skip
        started = time.monotonic()
        deadline = started + self.assignment.peer_lost_wait_s
        _close(self.link)
        while (left := deadline - time.monotonic()) > 0:
            assignment = _ask_rescue(self.assignment, left)
            if assignment is None:
                break
            self.assignment = assignment
            os.environ[ASSIGNMENT_ENV] = assignment.model_dump_json()
            try:
                self.link = _open(assignment)  # JOIN: admitted at the new peer's next step boundary
                self._header = self.link.send_header(self._step_tokens, first_layer=layer)
                answer = self.link.exchange(hidden, topk, out)
            except (PeerLostError, RuntimeError) as again:  # that peer died too, or never admitted us
                logger.warning("new FFN peer %d failed (%s)", assignment.ffn_rank, again)
                _close(self.link)
                continue
            self.resumes += 1
            logger.warning("forward pass resumed at layer %d on FFN peer %d (epoch %d) after %.2f s", layer,
                           assignment.ffn_rank, assignment.epoch, time.monotonic() - started)  # fmt: skip
            return answer
        raise PeerLostError(self.assignment.peer, f"no new FFN peer within {self.assignment.peer_lost_wait_s} s "
                            "(connector.peer_lost_wait_s)") from lost  # fmt: skip


def _open(assignment: AttentionAssignment) -> AttentionLink:
    return AttentionChannel(
        assignment.address, assignment.peer, assignment.epoch, assignment.transport, assignment.timeout_s
    )


def _close(link: AttentionLink) -> None:
    """Close a link whose peer may be dead (its LEAVE may not arrive)."""
    try:
        link.close()
    except Exception:  # noqa: BLE001 - the peer is gone; nothing left to release there
        logger.debug("closing the link to a lost FFN peer failed", exc_info=True)


def _ask_rescue(current: AttentionAssignment, wait_s: float) -> AttentionAssignment | None:
    """The assignment after `current` (a newer epoch), from the `AttentionServer`'s
    rescue endpoint; None if it did not answer within `wait_s` seconds."""
    context = zmq.Context.instance()
    with context.socket(zmq.REQ) as socket:
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(current.rescue)
        socket.send_string(current.model_dump_json())
        if not socket.poll(int(wait_s * 1000)):
            return None
        return AttentionAssignment.model_validate_json(socket.recv_string())


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
    if _client is not None and _client.assignment.epoch >= assignment.epoch:
        return  # already there: it moved inside a forward pass when its old peer died
    reset_ffn_client()
    os.environ[ASSIGNMENT_ENV] = assignment.model_dump_json()
    _client = FFNClient(assignment)
