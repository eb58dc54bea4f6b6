"""One attention rank: a vLLM `AsyncLLM` behind vLLM's own OpenAI serving layer.

`AttentionServer` is the body of the attention pool's Serve deployment (the builder
in `afd_ray.serve.app` applies `serve.deployment`). Tokenization, chat templates,
sampling-parameter checks, detokenization and SSE framing are vLLM's
(`OpenAIServingChat`, `OpenAIServingCompletion`); this class only starts the engine
and hands requests through.

Membership: the rank registers with the coordinator (STARTING), reports READY once
its engine serves, and polls the coordinator every `_WATCH_PERIOD_S`. When the
coordinator moves it to another FFN peer, the worker re-peers between two engine
steps (`AFDWorkerExtension.afd_repeer`). When Serve stops the replica (scale-in),
the coordinator marks it DRAINING; Serve routes it no new request, and requests
still running `autoscale.drain_timeout_s` later end with an explicit error (503,
or an SSE error event). Its destructor then closes the pair channel (LEAVE).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Collection
from pathlib import Path

import ray
import zmq
import zmq.asyncio
from ray import serve
from ray.serve.handle import DeploymentHandle
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.entrypoints.openai.models.protocol import BaseModelPath
from vllm.entrypoints.openai.models.serving import OpenAIServingModels
from vllm.renderers.online_renderer import OnlineRenderer
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

from afd_ray.attention.engine import engine_args, engine_env
from afd_ray.attention.ffn_client import ASSIGNMENT_ENV
from afd_ray.compat import (
    ErrorInfo,
    ErrorResponse,
    ModelList,
    create_error_response,
    num_unfinished_requests,
    validate_token_ids,
    warmup_renderer,
)
from afd_ray.config import (
    AttentionPoolConfig,
    AutoscaleConfig,
    ConnectorConfig,
    GatePlacement,
    ModelConfig,
    ObservabilityConfig,
)
from afd_ray.control.membership import AttentionAssignment, AttentionDirective, AttentionMember, MemberState
from afd_ray.control.serve_api import app_deleting
from afd_ray.models.embedded import resolve_checkpoint
from afd_ray.observability.publish import AttentionPublisher
from afd_ray.observability.recorder import AttentionRecorder
from afd_ray.observability.steps import AttentionStep
from afd_ray.platform import lower_data_plane_priority
from afd_ray.serve.protocol import ChatChunk, CompletionChunk

__all__ = ["AttentionServer", "next_assignment"]

logger = logging.getLogger(__name__)

_REPORT_PERIOD_S = 1.0
"""How often an attention rank sends its autoscaling signals to the coordinator."""
_WATCH_PERIOD_S = 0.5
"""How often an attention rank asks the coordinator for its state and FFN peer."""

class AttentionServer:
    """A vLLM engine that owns its requests and KV cache, serving OpenAI requests.

    `chat` and `completions` are async generators so that one Serve streaming handle
    carries both kinds of answer. Each yields either

    - exactly one item, a response model or an `ErrorResponse` (a non-streaming
      request, or a request of either kind rejected before generation), or
    - `str` items, each one SSE event (`"data: {...}\\n\\n"`), the last being
      `"data: [DONE]\\n\\n"` (an accepted `stream: true` request).

    Bad input never raises: it comes back as an `ErrorResponse` whose
    `error.code` is the HTTP status and whose `error.param` names the field.
    Cancelling the generator (the client went away) aborts the request in vLLM.
    """

    async def __init__(
        self,
        model: ModelConfig,
        attention: AttentionPoolConfig,
        connector: ConnectorConfig,
        gate_placement: GatePlacement,
        coordinator: DeploymentHandle,
        autoscale: AutoscaleConfig,
        observability: ObservabilityConfig = ObservabilityConfig(),
    ) -> None:
        """Get an FFN peer from the coordinator, then start the engine; returns once
        it is ready to serve (and reported READY).

        The engine process environment (`engine_env`, plus the FFN peer assignment
        under `AFD_RAY_ASSIGNMENT`) is set in this process first, so vLLM's EngineCore
        and worker processes inherit it; the worker opens the pair channel from it.

        Raises:
            ValueError: `model.source` cannot be resolved to a checkpoint folder, or
                its architecture has no AFD class.
            TimeoutError: the FFN layout did not serve within
                `autoscale.resize_timeout_s` (a starting FFN rank is waited for as
                long as a resize may take: under load its start can outlast
                `connector.timeout_s`, the bound on a running peer).
        """
        replica = serve.get_replica_context().replica_id.unique_id
        node = ray.get_runtime_context().get_node_id()
        self._rescue = zmq.asyncio.Context.instance().socket(zmq.REP)
        self._rescue.setsockopt(zmq.LINGER, 0)
        port = self._rescue.bind_to_random_port("tcp://127.0.0.1")
        self._rescue_fields = {"rescue": f"tcp://127.0.0.1:{port}", "peer_lost_wait_s": connector.peer_lost_wait_s}
        wait_s = autoscale.resize_timeout_s
        assignment = self._with_rescue(await coordinator.assign_attention.remote(wait_s, replica, node))
        self.rank = assignment.peer
        self._replica, self._node = replica, node
        self._assignment = assignment
        self._coordinator = coordinator
        self._rescuer = asyncio.create_task(self._serve_rescue())
        self._drain_timeout_s = autoscale.drain_timeout_s
        self._draining = asyncio.Event()
        """Set once the coordinator marked this rank DRAINING."""
        self._drained = asyncio.Event()
        """Set `drain_timeout_s` after draining began: running requests end with an error."""
        os.environ.update(engine_env(attention))
        os.environ[ASSIGNMENT_ENV] = assignment.model_dump_json()
        checkpoint = resolve_checkpoint(model)
        self._start(
            engine_args(model, attention, checkpoint, gate_placement), model.name, checkpoint, observability.metrics
        )
        self._publisher = AttentionPublisher(self.rank) if observability.metrics else None
        await self._engine.collective_rpc("afd_connect", args=(observability.step_records,))
        await coordinator.attention_ready.remote(self.rank)
        self._reporter = asyncio.create_task(self._report(coordinator))
        self._watcher = asyncio.create_task(self._watch())

    def _start(self, args: AsyncEngineArgs, served_name: str, checkpoint: Path, metrics: bool) -> None:
        """Start the engine from `args` and vLLM's OpenAI serving layer on it; the
        engine's stats feed `self._recorder` (autoscaling signals) and, with
        `metrics`, vLLM's own Ray stat logger (its `vllm:*` metrics through
        `ray.util.metrics`, as Ray Serve LLM exports them). The engine runs at the
        data plane's priority (`lower_data_plane_priority`, inherited by the
        EngineCore), here so that the benchmark's plain-vLLM engine runs at the same
        priority as the AFD ones."""
        lower_data_plane_priority()
        self._recorder = AttentionRecorder()
        loggers = [self._recorder.factory, RayPrometheusStatLogger] if metrics else [self._recorder.factory]
        self._engine = AsyncLLM.from_engine_args(
            args, usage_context=UsageContext.OPENAI_API_SERVER, stat_loggers=loggers
        )
        self._models = OpenAIServingModels(
            self._engine, [BaseModelPath(name=served_name, model_path=str(checkpoint))]
        )
        renderer = OnlineRenderer(
            self._engine.model_config,
            self._engine.renderer,
            request_logger=None,
            chat_template=None,
            chat_template_content_format="auto",
        )
        warmup_renderer(renderer)
        self._chat = OpenAIServingChat(
            self._engine,
            self._models,
            "assistant",
            online_renderer=renderer,
            request_logger=None,
            chat_template=None,
            chat_template_content_format="auto",
        )
        self._completion = OpenAIServingCompletion(
            self._engine, self._models, online_renderer=renderer, request_logger=None
        )

    async def _report(self, coordinator: DeploymentHandle) -> None:
        """Every `_REPORT_PERIOD_S`: send the coordinator this rank's autoscaling
        signals and the worker's new step records, and export their metrics."""
        while True:
            await asyncio.sleep(_REPORT_PERIOD_S)
            (records,) = await self._engine.collective_rpc("afd_take_steps")
            steps = [AttentionStep(**{**r, "requests": tuple(r["requests"])}) for r in records]
            report = self._recorder.drain(num_unfinished_requests(self._engine))
            if self._publisher is not None:
                self._publisher.publish(steps)
            try:
                await coordinator.report_attention.remote(self.rank, report, steps)
            except Exception:  # the coordinator is restarting: the next report goes through
                logger.warning("attention rank %d: report to the coordinator failed", self.rank, exc_info=True)

    async def _watch(self) -> None:
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
            if assignment is not None and assignment.epoch > self._assignment.epoch:
                try:
                    await self._repeer(assignment)
                except Exception:  # logged; the next poll retries
                    logger.exception("attention rank %d: re-peering failed", self.rank)
            if directive.state is MemberState.DRAINING and not self._draining.is_set():
                self._draining.set()
                logger.info("attention rank %d draining for up to %.0f s", self.rank, self._drain_timeout_s)
                asyncio.get_running_loop().call_later(self._drain_timeout_s, self._drained.set)

    async def _rejoin(self) -> None:
        """Re-register with a restarted coordinator: this rank, its FFN peer and
        pairing epoch, and whether it drains."""
        state = MemberState.DRAINING if self._draining.is_set() else MemberState.READY
        member = AttentionMember(
            rank=self.rank, ffn_peer=self._assignment.ffn_rank, state=state, epoch=self._assignment.epoch,
            replica=self._replica, node=self._node, peered_epoch=self._assignment.epoch,
        )  # fmt: skip
        await self._coordinator.rejoin_attention.remote(member)
        logger.info("attention rank %d rejoined the coordinator", self.rank)

    def _with_rescue(self, assignment: AttentionAssignment) -> AttentionAssignment:
        """`assignment` with this server's rescue endpoint, for the worker."""
        return assignment.model_copy(update=self._rescue_fields)

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
            new = await next_assignment(lambda: self._coordinator.attention_poll.remote(self.rank), held,
                                        _WATCH_PERIOD_S / 2)  # fmt: skip
            if new is None:
                logger.warning("attention rank %d: no FFN peer after %d within %.0f s (connector.peer_lost_wait_s)",
                               self.rank, held.ffn_rank, held.peer_lost_wait_s)  # fmt: skip
                await self._rescue.send_string(held.model_dump_json())
                continue
            assignment = self._with_rescue(new)
            self._assignment = assignment  # `_watch` must not re-peer the engine once more
            os.environ[ASSIGNMENT_ENV] = assignment.model_dump_json()
            await self._rescue.send_string(assignment.model_dump_json())
            await self._coordinator.attention_peered.remote(self.rank, assignment.epoch)
            logger.warning("attention rank %d: lost FFN peer %d mid-pass (it died, or its EP group failed); its "
                           "worker moves to FFN peer %d (epoch %d)", self.rank, held.ffn_rank, assignment.ffn_rank,
                           assignment.epoch)  # fmt: skip

    async def _repeer(self, assignment: AttentionAssignment) -> None:
        """Close the pair with the old FFN peer (LEAVE) and join the new one, between
        two engine steps of the worker."""
        old = self._assignment
        assignment = self._with_rescue(assignment)
        await self._engine.collective_rpc("afd_repeer", args=(assignment.model_dump_json(),))
        self._assignment = assignment
        os.environ[ASSIGNMENT_ENV] = assignment.model_dump_json()
        await self._coordinator.attention_peered.remote(self.rank, assignment.epoch)
        logger.info("attention rank %d: FFN peer %d (epoch %d) -> %d (epoch %d)", self.rank, old.ffn_rank,
                    old.epoch, assignment.ffn_rank, assignment.epoch)  # fmt: skip

    async def chat(self, request: ChatCompletionRequest) -> AsyncGenerator[ChatChunk, None]:
        """Answer `POST /v1/chat/completions`; see the class docstring for the items."""
        if self._engine.errored:
            yield _engine_failed(self.rank)
            return
        answer = self._chat.create_chat_completion(request)
        async for item in self._until_drained(_relay(answer, type(request).model_fields)):
            yield item

    async def completions(
        self, request: CompletionRequest
    ) -> AsyncGenerator[CompletionChunk, None]:
        """Answer `POST /v1/completions`; see the class docstring for the items."""
        if self._engine.errored:
            yield _engine_failed(self.rank)
            return
        try:
            for ids in _prompt_token_ids(request.prompt):
                validate_token_ids(self._engine.renderer, ids, "prompt")
        except VLLMValidationError as exc:
            yield _error(exc)
            return
        answer = self._completion.create_completion(request)
        async for item in self._until_drained(_relay(answer, type(request).model_fields)):
            yield item

    async def _until_drained(self, items: AsyncGenerator[object, None]) -> AsyncGenerator[object, None]:
        """The items of `items` until the drain timeout passes; then the request is
        aborted in vLLM (its generator is closed) and ends with a 503 error: an error
        body if nothing was sent yet, else an SSE error event and `[DONE]`."""
        streamed = False
        try:
            while not self._drained.is_set():
                if not self._draining.is_set():  # serving: no race, no extra task per item
                    try:
                        value = await anext(items)
                    except StopAsyncIteration:
                        return
                    streamed = streamed or isinstance(value, str)
                    yield value
                    continue
                item = asyncio.ensure_future(anext(items))
                drained = asyncio.ensure_future(self._drained.wait())
                await asyncio.wait((item, drained), return_when=asyncio.FIRST_COMPLETED)
                drained.cancel()
                if not item.done():
                    item.cancel()  # vLLM aborts the request
                    await asyncio.gather(item, return_exceptions=True)
                    break
                try:
                    value = item.result()
                except StopAsyncIteration:
                    return
                streamed = streamed or isinstance(value, str)
                yield value
            error = _drain_error(self.rank, self._drain_timeout_s)
            if streamed:
                yield f"data: {json.dumps(error.model_dump())}\n\n"
                yield "data: [DONE]\n\n"
            else:
                yield error
        finally:
            await items.aclose()

    async def models(self) -> ModelList:
        """The served model, as `GET /v1/models` lists it."""
        return await self._models.show_available_models()

    async def num_unfinished_requests(self) -> int:
        """Requests the engine holds now: admitted and neither finished nor aborted."""
        return num_unfinished_requests(self._engine)

    async def param_bytes(self) -> dict[str, int]:
        """Resident parameter bytes of the attention-role model in the vLLM worker,
        keyed by parameter name without layer indices (`AFDWorkerExtension`)."""
        (totals,) = await self._engine.collective_rpc("afd_param_bytes")
        return totals

    async def graphs_captured(self) -> int:
        """CUDA graphs the vLLM worker captured (`AFDWorkerExtension.afd_graphs_captured`)."""
        (count,) = await self._engine.collective_rpc("afd_graphs_captured")
        return count

    async def graph_replays(self) -> int:
        """Forward passes replayed as whole-step CUDA graphs (`AFDWorkerExtension.afd_graph_replays`)."""
        (count,) = await self._engine.collective_rpc("afd_graph_replays")
        return count

    async def check_health(self) -> None:
        """Serve's periodic health check.

        Raises:
            vllm.v1.engine.exceptions.EngineDeadError: the engine process died;
                Serve then replaces this replica.
        """
        await self._engine.check_health()

    async def __del__(self) -> None:
        """Serve stops this replica after draining it: close the pair channel to the
        FFN peer (LEAVE, between engine steps), report GONE, stop the EngineCore."""
        if not hasattr(self, "_engine"):
            return
        try:
            deleting = await app_deleting(serve.get_replica_context().app_name)
            if not deleting:
                await self._coordinator.attention_leaving.remote(self.rank)
            self._drained.set()
            await self._engine.collective_rpc("afd_close")
            if not deleting:
                await self._coordinator.attention_gone.remote(self.rank)
        finally:
            self._rescue.close()
            self._engine.shutdown()


async def _relay(answer: Awaitable[object], fields: Collection[str]) -> AsyncGenerator[object, None]:
    """The items of one vLLM serving call: its SSE events when it streams, else the
    one response or error body; an exception becomes an error body. An error body
    names the request field (one of `fields`) its message begins with
    (`_naming_the_field`)."""
    try:
        result = await answer
    except Exception as exc:  # noqa: BLE001 - every failure becomes an error body
        yield _naming_the_field(_error(exc), fields)
        return
    if isinstance(result, AsyncIterator):
        async for event in result:
            yield event
    elif isinstance(result, ErrorResponse):
        yield _naming_the_field(result, fields)
    else:
        yield result


def _naming_the_field(response: ErrorResponse, fields: Collection[str]) -> ErrorResponse:
    """`response` with `error.param` set to the request field its message begins with,
    when it is a 4xx that names none: vLLM's sampling checks say e.g. `top_k must be 0
    (disable), or at least 1, got -5.` or `n must be 1 when using greedy sampling` and
    leave `param` empty. `fields`: the request model's field names."""
    error = response.error
    first = re.match(r"[A-Za-z_]\w*", error.message.lstrip())
    if error.param is not None or error.code >= 500 or first is None or first.group() not in fields:
        return response
    return response.model_copy(update={"error": error.model_copy(update={"param": first.group()})})


def _prompt_token_ids(prompt: object) -> list[list[int]]:
    """The token-id prompts of a completion's `prompt` (vLLM's `CompletionRequest`:
    text, a list of texts, one list of token ids, or a list of them)."""
    if isinstance(prompt, list) and prompt and all(isinstance(item, int) for item in prompt):
        return [prompt]
    if isinstance(prompt, list):
        return [item for item in prompt if isinstance(item, list)]
    return []


def _drain_error(rank: int, timeout_s: float) -> ErrorResponse:
    """The 503 body of a request still running when its rank's drain timeout passed."""
    message = (f"attention rank {rank} was removed by a resize and the request did not finish within "
               f"the drain timeout ({timeout_s:.0f} s, autoscale.drain_timeout_s); retry it")  # fmt: skip
    return ErrorResponse(error=ErrorInfo(message=message, type="ServiceUnavailableError", code=503))


def _engine_failed(rank: int) -> ErrorResponse:
    """The 503 body of a request routed to a rank whose engine failed (its FFN peer was
    lost mid-step); Serve's health check replaces the rank."""
    message = f"attention rank {rank}'s engine failed (its FFN peer was lost) and is being replaced; retry it"
    return ErrorResponse(error=ErrorInfo(message=message, type="ServiceUnavailableError", code=503))


def _error(exc: Exception) -> ErrorResponse:
    """vLLM's mapping of an exception to an OpenAI error body (4xx for bad input)."""
    response = create_error_response(exc)
    if response.error.code >= 500:
        logger.exception("request failed", exc_info=exc)
    return response


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
