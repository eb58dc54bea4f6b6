"""One attention rank: a vLLM `AsyncLLM` behind vLLM's own OpenAI serving layer.

`AttentionServer` is the body of the attention pool's Serve deployment (the builder
in `afd_ray.serve.app` applies `serve.deployment`). Tokenization, chat templates,
sampling-parameter checks and detokenization are vLLM's (`OpenAIServingChat`,
`OpenAIServingCompletion`); this class only starts the engine and hands requests
through, its answers as typed items (`afd_ray.attention.responses`); the ingress
frames SSE.

Membership (register, READY, reports, polls, re-peering, the rescue endpoint, LEAVE)
is `afd_ray.attention.member.Member`'s. When Serve stops the replica (scale-in), the
coordinator marks it DRAINING; Serve routes it no new request, and requests still
running `autoscale.drain_timeout_s` later end with an explicit error (503, or an SSE
error event). Its destructor then closes the pair channel (LEAVE).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncGenerator
from pathlib import Path

from ray.serve.handle import DeploymentHandle
from vllm.config import VllmConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest, ChatCompletionStreamResponse
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.protocol import CompletionRequest, CompletionStreamResponse
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.entrypoints.openai.models.protocol import BaseModelPath
from vllm.entrypoints.openai.models.serving import OpenAIServingModels
from vllm.renderers.online_renderer import OnlineRenderer
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.ray_wrappers import RayPrometheusStatLogger

from afd_ray.attention.chunks import ChatChunk, CompletionChunk
from afd_ray.attention.engine import engine_args, engine_env
from afd_ray.attention.member import Member
from afd_ray.attention.responses import (
    drain_error,
    engine_failed,
    error_of,
    prompt_token_ids,
    relay,
    until_drained,
)
from afd_ray.compat import (
    ModelList,
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
from afd_ray.models.embedded import resolve_checkpoint
from afd_ray.observability.publish import AttentionPublisher
from afd_ray.observability.recorder import AttentionRecorder
from afd_ray.platform import lower_data_plane_priority

__all__ = ["AttentionServer"]


class AttentionServer:
    """A vLLM engine that owns its requests and KV cache, serving OpenAI requests.

    `chat` and `completions` are async generators so that one Serve streaming handle
    carries both kinds of answer. Each yields typed items (`afd_ray.attention.chunks`):
    exactly one response model or `ErrorResponse` (a non-streaming request, or a
    request of either kind rejected before generation), or `StreamEvent`s, possibly
    ended by a `StreamError` (an accepted `stream: true` request).

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

        The engine process environment (`engine_env`) is set in this process first, so
        vLLM's EngineCore and worker processes inherit it. The FFN peer reaches the
        worker in the engine's config (`engine_args`); the worker opens the pair
        channel from it when vLLM builds the model.

        Raises:
            ValueError: `model.source` cannot be resolved to a checkpoint folder, or
                its architecture has no AFD class. Whatever fails after the rank
                registered (e.g. vLLM refusing the engine at start) is raised after
                the rank is reported gone (`_failed_start`).
            TimeoutError: the FFN layout did not serve within
                `autoscale.resize_timeout_s` (a starting FFN rank is waited for as
                long as a resize may take: under load its start can outlast
                `connector.timeout_s`, the bound on a running peer).
        """
        self._member = await Member.join(coordinator, connector, autoscale)
        self.rank = self._member.rank
        self._drain_timeout_s = autoscale.drain_timeout_s
        self._draining: asyncio.Event = self._member.draining
        """Set once the coordinator marked this rank DRAINING."""
        self._drained: asyncio.Event = self._member.drained
        """Set `drain_timeout_s` after draining began: running requests end with an error."""
        try:
            os.environ.update(engine_env(attention))
            checkpoint = resolve_checkpoint(model)
            args = engine_args(model, attention, checkpoint, gate_placement, self._member.assignment)
            self._start(args, model.name, checkpoint, observability.metrics)
            publisher = AttentionPublisher(self.rank) if observability.metrics else None
            await self._member.serve(self._engine, self._recorder, publisher, observability.step_records)
        except Exception:
            await self._failed_start()
            raise

    async def _failed_start(self) -> None:
        """The engine did not start (or not connect): shut it down if it started and
        tell the coordinator this rank is gone (`Member.abandon`), so that neither
        `/afd/status` nor the pool size counts it while Serve retries the replica.
        Serve may still call `__del__`: without an engine it does nothing."""
        engine: AsyncLLM | None = getattr(self, "_engine", None)
        try:
            if engine is not None:
                del self._engine
                engine.shutdown()
        finally:
            await self._member.abandon()

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
        self._models = OpenAIServingModels(self._engine, [BaseModelPath(name=served_name, model_path=str(checkpoint))])
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

    async def chat(self, request: ChatCompletionRequest) -> AsyncGenerator[ChatChunk, None]:
        """Answer `POST /v1/chat/completions`; see the class docstring for the items."""
        if self._engine.errored:
            yield engine_failed(self.rank)
            return
        answer = relay(
            self._chat.create_chat_completion(request), type(request).model_fields, ChatCompletionStreamResponse
        )
        async for item in self._until_drained(answer):
            yield item

    async def completions(self, request: CompletionRequest) -> AsyncGenerator[CompletionChunk, None]:
        """Answer `POST /v1/completions`; see the class docstring for the items."""
        if self._engine.errored:
            yield engine_failed(self.rank)
            return
        try:
            for ids in prompt_token_ids(request.prompt):
                validate_token_ids(self._engine.renderer, ids, "prompt")
        except VLLMValidationError as exc:
            yield error_of(exc)
            return
        answer = relay(
            self._completion.create_completion(request), type(request).model_fields, CompletionStreamResponse
        )
        async for item in self._until_drained(answer):
            yield item

    def _until_drained(self, items: AsyncGenerator[object, None]) -> AsyncGenerator[object, None]:
        """`items` until this rank's drain timeout passes, then a 503 (`until_drained`)."""
        return until_drained(
            items, self._draining, self._drained, lambda: drain_error(self.rank, self._drain_timeout_s)
        )

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

    async def vllm_config(self) -> VllmConfig:
        """The engine's resolved vLLM config (what vLLM logs at start): the settings
        `attention.engine_args` and vLLM's defaults gave it."""
        return self._engine.vllm_config

    async def graphs_captured(self) -> int:
        """CUDA graphs the vLLM worker captured (`AFDWorkerExtension.afd_graphs_captured`)."""
        (count,) = await self._engine.collective_rpc("afd_graphs_captured")
        return count

    async def graph_replays(self) -> int:
        """Forward passes replayed as whole-step CUDA graphs (`AFDWorkerExtension.afd_graph_replays`)."""
        (count,) = await self._engine.collective_rpc("afd_graph_replays")
        return count

    async def device_trace(self, start: bool) -> None:
        """Start (`start`) or stop vLLM's engine profiler, set up by the engine argument
        `profiler_config` (`afd_ray.observability.device_trace`); stopping writes its
        trace unless it stopped itself after its `max_iterations`.

        Raises:
            RuntimeError: the engine has no profiler configured (from vLLM's worker).
        """
        await (self._engine.start_profile() if start else self._engine.stop_profile())

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
            await self._member.leave(self._engine)
        finally:
            self._member.close()
            self._engine.shutdown()
