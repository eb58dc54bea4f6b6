"""The OpenAI-compatible HTTP front: parses requests, forwards them to the attention
pool over Serve handles, and turns answers into JSON or SSE responses.

Requests are parsed into vLLM's own protocol models, so the accepted fields and
their checks are exactly vLLM's. Every error leaves as an OpenAI error body,
`{"error": {"message", "type", "param", "code"}}` with `param` naming the field and
`code` equal to the HTTP status; the replicas are never disturbed by bad input.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.exceptions import HTTPException as StarletteHTTPException
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

from afd_ray.attention.server import ChatChunk, CompletionChunk
from afd_ray.compat import (
    VLLM_REQUEST_ERRORS,
    ErrorInfo,
    ErrorResponse,
    ModelList,
    clean_loc_for_param,
    create_error_response,
)
from afd_ray.config import AttentionPoolConfig, FFNPoolConfig
from afd_ray.control.membership import ScaleRequest

__all__ = ["Ingress", "app"]

logger = logging.getLogger(__name__)

app = FastAPI(title="afd_ray", summary="OpenAI-compatible API of an AFD deployment")


def _error_response(error: ErrorResponse) -> JSONResponse:
    return JSONResponse(error.model_dump(), status_code=error.error.code)


@app.exception_handler(RequestValidationError)
async def _invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
    """A body that is not JSON, or does not fit vLLM's request model: 400."""
    first = exc.errors()[0]
    # loc is ("body", field, ...); for malformed JSON it is ("body", offset).
    field = first["loc"][1:] if first["type"] != "json_invalid" else ()
    param = clean_loc_for_param(field) if field else "body"
    more = f" (and {len(exc.errors()) - 1} more errors)" if len(exc.errors()) > 1 else ""
    error = ErrorInfo(
        message=f"{param}: {first['msg']}{more}",
        type="BadRequestError",
        param=param,
        code=HTTPStatus.BAD_REQUEST,
    )
    return _error_response(ErrorResponse(error=error))


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own HTTP errors (a body it cannot even parse, e.g. invalid UTF-8; an
    unknown route; a wrong method) in the OpenAI error shape, same status."""
    error = ErrorInfo(
        message=str(exc.detail),
        type="BadRequestError" if exc.status_code == HTTPStatus.BAD_REQUEST else HTTPStatus(exc.status_code).phrase,
        param="body" if exc.status_code == HTTPStatus.BAD_REQUEST else None,
        code=exc.status_code,
    )
    return _error_response(ErrorResponse(error=error))


async def _vllm_error(_: Request, exc: Exception) -> JSONResponse:
    """A check inside vLLM's request models (e.g. no `prompt`): vLLM's own status."""
    return _error_response(create_error_response(exc))


for _error in VLLM_REQUEST_ERRORS:
    app.add_exception_handler(_error, _vllm_error)


@app.exception_handler(Exception)
async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    """Anything else (a replica died, a bug): 500 with an OpenAI error body."""
    logger.exception("request failed", exc_info=exc)
    error = ErrorInfo(
        message=f"{type(exc).__name__}: internal error",
        type="InternalServerError",
        code=HTTPStatus.INTERNAL_SERVER_ERROR,
    )
    return _error_response(ErrorResponse(error=error))


async def _respond(answer: DeploymentResponseGenerator) -> Response:
    """JSON for a single response or error item, SSE for a stream of `str` events."""
    first: ChatChunk | CompletionChunk = await anext(answer)
    if isinstance(first, ErrorResponse):
        return _error_response(first)
    if not isinstance(first, str):
        return JSONResponse(first.model_dump())
    return StreamingResponse(_events(first, answer), media_type="text/event-stream")


async def _events(first: str, rest: DeploymentResponseGenerator) -> AsyncIterator[str]:
    """The SSE events of one stream; if the attention replica fails mid-stream (it
    died, or was killed past its drain timeout), a final SSE error event (503) and
    `[DONE]` instead of a cut connection."""
    yield first
    try:
        async for event in rest:
            yield event
    except Exception as exc:
        logger.exception("stream failed", exc_info=exc)
        error = ErrorInfo(
            message=f"the attention rank serving this request failed ({type(exc).__name__}); retry it",
            type="ServiceUnavailableError",
            code=HTTPStatus.SERVICE_UNAVAILABLE,
        )
        yield f"data: {json.dumps(ErrorResponse(error=error).model_dump())}\n\n"
        yield "data: [DONE]\n\n"


@serve.ingress(app)
class Ingress:
    """The HTTP routes of the application (wrap with `serve.deployment` to deploy).

    Args:
        attention: handle to the `AttentionServer` deployment (the attention pool).
        coordinator: handle to the `Coordinator` deployment.
        ffn: handle to the `FFNServer` deployment (the FFN pool), for health only;
            no request is ever routed there.
        attention_pool, ffn_pool: the pools' resize bounds (`min_ranks`, `max_ranks`),
            checked on `POST /afd/scale`.
    """

    def __init__(
        self,
        attention: DeploymentHandle,
        coordinator: DeploymentHandle,
        ffn: DeploymentHandle,
        attention_pool: AttentionPoolConfig,
        ffn_pool: FFNPoolConfig,
    ) -> None:
        self._bounds = {"attention": attention_pool, "ffn": ffn_pool}
        self._attention = attention
        self._attention_stream = attention.options(stream=True)
        self._coordinator = coordinator
        self._ffn = ffn

    @app.get("/v1/models")
    async def models(self) -> ModelList:
        """The served model (OpenAI `GET /v1/models`)."""
        return await self._attention.models.remote()

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(self, request: ChatCompletionRequest) -> Response:
        """OpenAI chat completions; `stream: true` answers `text/event-stream`."""
        return await _respond(self._attention_stream.chat.remote(request))

    @app.post("/v1/completions", response_model=None)
    async def completions(self, request: CompletionRequest) -> Response:
        """OpenAI text completions; `stream: true` answers `text/event-stream`."""
        return await _respond(self._attention_stream.completions.remote(request))

    @app.get("/health")
    async def health(self) -> Response:
        """200 when an attention replica and an FFN replica pass their health checks,
        else 503."""
        try:
            await self._attention.check_health.remote()
            await self._ffn.check_health.remote()
        except Exception:
            logger.exception("health check failed")
            return Response(status_code=HTTPStatus.SERVICE_UNAVAILABLE)
        return Response(status_code=HTTPStatus.OK)

    # --- AFD control plane ---------------------------------------------------------

    @app.get("/afd/status", response_model=None)
    async def afd_status(self) -> Response:
        """The coordinator's view of both pools (`AFDStatus`)."""
        status = await self._coordinator.status.remote()
        return JSONResponse(status.model_dump(mode="json"))

    @app.get("/afd/trace/{request_id}", response_model=None)
    async def afd_trace(self, request_id: str) -> Response:
        """The engine steps of request `request_id` (its OpenAI `id`) split across the
        pools (`afd_ray.observability.steps.TokenBreakdown`), or 404 when no step
        record names it (unknown id, or older than the ring buffers)."""
        steps = await self._coordinator.trace.remote(request_id)
        if not steps:
            error = ErrorInfo(
                message=f"request_id: no step record names {request_id!r} (unknown, or evicted from the "
                "observability.step_records ring buffers)",
                type="NotFoundError", param="request_id", code=HTTPStatus.NOT_FOUND,
            )  # fmt: skip
            return _error_response(ErrorResponse(error=error))
        return JSONResponse({"request_id": request_id, "steps": [step.model_dump(mode="json") for step in steps]})

    @app.post("/afd/scale", response_model=None)
    async def afd_scale(self, request: Request) -> Response:
        """Resize the pools to the body's `{"attention": int, "ffn": int}` and answer
        once the new layout serves, with the `ResizeEvent` (200), or 504 with the
        event if it did not complete. A body that does not fit, or a size outside
        the pool's `min_ranks`..`max_ranks`, is a 400 naming the field. Pauses the
        autoscaler until `POST /afd/autoscale/resume`. An accepted resize runs to its
        end even if the client disconnects; its event is in `/afd/status` `resizes`."""
        try:
            body = await request.json()
        except ValueError:
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body", 0), "msg": "invalid JSON"}])
        try:
            scale = ScaleRequest.model_validate(body)
        except ValidationError as exc:
            raise RequestValidationError([error | {"loc": ("body", *error["loc"])} for error in exc.errors()])
        for field, pool in self._bounds.items():
            value = getattr(scale, field)
            if not pool.min_ranks <= value <= pool.upper:
                error = ErrorInfo(
                    message=f"{field}: {value} is outside [{pool.min_ranks}, {pool.upper}] "
                    f"({field}.min_ranks, {field}.max_ranks of the deployment)",
                    type="BadRequestError",
                    param=field,
                    code=HTTPStatus.BAD_REQUEST,
                )
                return _error_response(ErrorResponse(error=error))
        event = await self._coordinator.scale.remote(scale)
        status = HTTPStatus.OK if event.error is None else HTTPStatus.GATEWAY_TIMEOUT
        return JSONResponse(event.model_dump(mode="json"), status_code=status)

    @app.post("/afd/autoscale/resume", response_model=None)
    async def afd_autoscale_resume(self) -> Response:
        """Let the autoscaler resize the pools again after a manual resize. The answer
        also says whether the deployment runs an autoscaler at all (`autoscale.enabled`)."""
        await self._coordinator.resume_autoscaler.remote()
        status = await self._coordinator.status.remote()
        return JSONResponse({"autoscale_paused": status.autoscale_paused, "autoscale_enabled": status.autoscale_enabled})
