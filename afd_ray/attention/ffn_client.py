"""The attention side's FFN client: one per vLLM worker process.

The runtime, not the model, owns the connector. The AttentionServer hands its first
`AttentionAssignment` to the engine inside vLLM's own config (`FFNPeerConfig`, the
engine's `additional_config`); the worker opens the pair link from it when vLLM builds
the AFD model (`afd_ray.attention.worker`), so vLLM's own profile and warm-up forwards
already run through the FFN peer. The model's ops find the client through one hook,
`afd_ray.attention.ffn_op.use_ffn_client`.

The client uses only the connector contract (`afd_ray.connector.link.AttentionLink`);
`AttentionChannel` opens the transport the assignment names.

An FFN peer that dies inside a forward pass costs a pause, not the pass (docs/failures.md):
on `PeerLostError` the client asks its `AttentionServer` (over the assignment's
`rescue` endpoint, `afd_ray.attention.member`) for the new peer the coordinator assigns
once it re-formed the FFN layout, joins it, announces the rest of the step
(`first_layer` = the current layer) and repeats the current layer's exchange. The FFN
side holds no request state, so the result is the same; vLLM never sees an error. Past
`peer_lost_wait_s` the error is raised (the engine fails; its requests end with an
explicit error).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import zmq
from pydantic import BaseModel, ConfigDict

from afd_ray.connector.channel import AttentionChannel
from afd_ray.connector.header import StepHeader
from afd_ray.connector.link import AttentionLink, PeerLostError
from afd_ray.control.membership import AttentionAssignment
from afd_ray.observability.steps import AttentionStep, StepRing

__all__ = ["FFNClient", "FFNPeerConfig", "capturing", "record_steps", "take_steps"]

logger = logging.getLogger(__name__)

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


class FFNPeerConfig(BaseModel):
    """vLLM's `additional_config` of an AFD attention engine: the FFN peer its worker
    pairs with first (`afd_ray.attention.engine.engine_args`).

    vLLM hashes `additional_config` into `VllmConfig.compute_hash`, the key of its
    torch.compile cache: as a dict, by its JSON. The assignment's ports and epoch change
    at every start and do not change the compiled graph (the exchange runs in opaque
    custom ops), so this object's `compute_hash` leaves them out; a dict would miss
    the cache at every start.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    assignment: AttentionAssignment

    def compute_hash(self) -> str:
        """This config's part of vLLM's compile-cache key: a constant (see the class docstring)."""
        return "afd_ray.ffn_peer"


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

    def close(self) -> None:
        """Keep the last step's timing record and close the pair link (LEAVE)."""
        self._record()
        self.link.close()

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
            raise ValueError(f"layer {layer}: {hidden.shape[0]} rows in a step announced with {self._step_tokens}")
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
            _steps.append(
                AttentionStep(
                    header.peer,
                    header.epoch,
                    header.step_id,
                    self._start_s,
                    header.num_tokens,
                    self._exchange_s,
                    self._requests,
                    self._replayed,
                )
            )

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
        logger.warning(
            "FFN peer %d lost at layer %d (%s); waiting for a new peer", self.assignment.ffn_rank, layer, lost
        )
        started = time.monotonic()
        deadline = started + self.assignment.peer_lost_wait_s
        _close(self.link)
        while (left := deadline - time.monotonic()) > 0:
            assignment = _ask_rescue(self.assignment, left)
            if assignment is None:
                break
            self.assignment = assignment
            try:
                self.link = _open(assignment)  # JOIN: admitted at the new peer's next step boundary
                self._header = self.link.send_header(self._step_tokens, first_layer=layer)
                answer = self.link.exchange(hidden, topk, out)
            except (PeerLostError, RuntimeError) as again:  # that peer died too, or never admitted us
                logger.warning("new FFN peer %d failed (%s)", assignment.ffn_rank, again)
                _close(self.link)
                continue
            self.resumes += 1
            logger.warning(
                "forward pass resumed at layer %d on FFN peer %d (epoch %d) after %.2f s",
                layer,
                assignment.ffn_rank,
                assignment.epoch,
                time.monotonic() - started,
            )
            return answer
        raise PeerLostError(
            self.assignment.peer,
            f"no new FFN peer within {self.assignment.peer_lost_wait_s} s (connector.peer_lost_wait_s)",
        ) from lost


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
