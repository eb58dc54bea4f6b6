"""The OpenAI-compatible HTTP front: parses requests, forwards them to the attention
pool over Serve handles, and turns answers into JSON or SSE responses.

Requests are parsed into vLLM's own protocol models, so the accepted fields and
their checks are exactly vLLM's. Every error leaves as an OpenAI error body,
`{"error": {"message", "type", "param", "code"}}` with `param` naming the field and
`code` equal to the HTTP status; the replicas are never disturbed by bad input.

Before a request reaches the attention pool it passes access control
(`afd_ray.serve.access`, 401) and admission (`afd_ray.serve.admission`, 429/503 with
`Retry-After`), both decided from its headers and the state the ingress already holds
before its body is read (`_AdmittedRoute`); an optional `x-request-deadline-ms` header
bounds its whole answer (504, or an SSE error event, once it passes).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.exceptions import HTTPException as StarletteHTTPException

from afd_ray.autoscale.policy import PolicyError, parse_policy
from afd_ray.compat import (
    VLLM_REQUEST_ERRORS,
    ErrorInfo,
    ErrorResponse,
    ModelList,
    clean_loc_for_param,
    create_error_response,
)
from afd_ray.config import AttentionPoolConfig, AutoscaleConfig, FFNPoolConfig, IngressConfig
from afd_ray.control.membership import PoolLoad, ScaleRequest
from afd_ray.serve.access import AccessKeys, Role
from afd_ray.serve.admission import DEADLINE_HEADER, LOAD_PERIOD_S, Admission, Refusal
from afd_ray.serve.protocol import ChatChunk, ChatCompletionRequest, CompletionChunk, CompletionRequest
from afd_ray.serve.resume import StreamResume

__all__ = ["Ingress", "app"]

logger = logging.getLogger(__name__)

app = FastAPI(title="afd_ray", summary="OpenAI-compatible API of an AFD deployment")

_RESUME_ATTEMPTS = 5
"""Times a resumable stream is moved to another attention rank before it ends with an
error (Serve may route a retry to the dead replica until it is replaced)."""
_RESUME_BACKOFF_S = 0.5
"""Wait before the k-th move: k x this, seconds."""
_T = TypeVar("_T")
_Endpoint = TypeVar("_Endpoint", bound=Callable[..., Awaitable[Response]])
_CALL_S = 10.0
"""Bound on a call of a route that is not inference (health, model list, status) to
a pool member or the coordinator, seconds: a Serve handle call waits for a running
replica without bound (an attention rank still starting, a hung coordinator), so past
this the route answers 503 with `Retry-After` instead of hanging. A coordinator that
has answered none of the ingress's load reads for this long is taken as down: its
routes answer 503 at once (`Ingress._ask`)."""


def _error_response(error: ErrorResponse) -> JSONResponse:
    return JSONResponse(error.model_dump(), status_code=error.error.code)


@app.exception_handler(RequestValidationError)
async def _invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
    """A body that is not JSON, or does not fit vLLM's request model: 400 naming the
    field (the most specific of its errors: `_most_specific`)."""
    first = _most_specific(exc.errors())
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


_TYPE_MISMATCHES = frozenset({"none_required", "literal_error", "is_instance_of", "union_tag_invalid"})
"""Pydantic error types (besides `*_type` and `*_parsing`) that say only that the
value is not of a union member's type."""


def _most_specific(errors: Sequence[dict]) -> dict:
    """Of the errors of the first failing field, the one that says the most: a field
    of several types (e.g. `stop`: a string or a list of at most 4 strings) fails
    once per type, and the first error ("Input should be a valid string") hides the
    one that names the real bound ("List should have at most 4 items"). Preferred: an
    error of a type the value has (a bound it breaks, not a type mismatch), then the
    deepest location (inside the member whose type matched)."""
    field = errors[0]["loc"][:2]

    def says(error: dict) -> tuple[bool, int]:
        kind = error["type"]
        mismatch = kind.endswith(("_type", "_parsing")) or kind in _TYPE_MISMATCHES
        return not mismatch, len(error["loc"])

    same = [error for error in errors if error["loc"][:2] == field]
    return max(same, key=says)  # the first of equals


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


class _Ticket:
    """One admitted request's place in the admission count, given back exactly once:
    when its answer ends, or when its unstarted SSE body is dropped (the client left
    before the first event was sent)."""

    def __init__(self, release: Callable[[bool], None]) -> None:
        self._release: Callable[[bool], None] | None = release

    def done(self, expired: bool = False) -> None:
        if self._release is not None:
            release, self._release = self._release, None
            release(expired)


@dataclass(frozen=True)
class _Pass:
    """What `_AdmittedRoute` hands an inference route whose request holds a place."""

    ticket: _Ticket
    """The place (`Admission.reserve`), given back when the answer ends."""
    budget_s: float | None
    """`x-request-deadline-ms` in seconds (None: no deadline)."""
    deadline: float | None
    """The monotonic time the answer must end by (None: no deadline)."""


class _AdmittedRoute(APIRoute):
    """An inference route whose request passes access control and admission's first
    step (`Ingress._reserve`) on its headers alone, before FastAPI reads and parses
    its body: a refusal needs none of it (through Serve's Python proxy the body came
    by another call, and under a burst a refusal that waited for it took 76 ms more,
    median, loaded 2-core machine; with direct ingress it comes from the connection). An
    admitted request's body is then read within `ingress.body_timeout_s` (else 408,
    and the place is given back; a client that goes away mid-body gives it back too).
    The route finds its place in `request.state.admitted` (`_Pass`); it is given back
    if the route fails (e.g. a body that does not validate: 400)."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def admitted(request: Request) -> Response:
            ingress: Ingress = serve.get_replica_context().servable_object
            refused = await ingress._reserve(request)
            if refused is not None:
                return refused
            try:
                await asyncio.wait_for(request.body(), ingress._body_timeout_s)  # cached for the handler
            except TimeoutError:
                _pass_of(request).ticket.done()
                return _error_response(_error(
                    HTTPStatus.REQUEST_TIMEOUT, f"body: the request body did not arrive within "
                    f"{ingress._body_timeout_s:g} s (ingress.body_timeout_s)", "RequestTimeoutError", "body",
                ))  # fmt: skip
            except BaseException:  # the client went away mid-body (ClientDisconnect), or cancelled
                _pass_of(request).ticket.done()
                raise
            try:
                return await handler(request)
            except BaseException:
                _pass_of(request).ticket.done()
                raise

        return admitted


def _inference(path: str) -> Callable[[_Endpoint], _Endpoint]:
    """Register `POST path` as an `_AdmittedRoute` of `app` (as `app.post` would)."""

    def register(endpoint: _Endpoint) -> _Endpoint:
        app.router.add_api_route(path, endpoint, methods=["POST"], response_model=None,
                                 route_class_override=_AdmittedRoute)  # fmt: skip
        return endpoint

    return register


def _pass_of(request: Request) -> _Pass:
    admitted: _Pass = request.state.admitted
    return admitted


def _error(status: HTTPStatus, message: str, kind: str, param: str | None = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status))


def _deadline_error(deadline_s: float) -> ErrorResponse:
    return _error(HTTPStatus.GATEWAY_TIMEOUT, f"{DEADLINE_HEADER}: the request did not finish within "
                  f"{deadline_s * 1e3:.0f} ms; it was aborted", "DeadlineExceededError", DEADLINE_HEADER)  # fmt: skip


async def _within(item: Awaitable[object], deadline: float | None) -> object:
    """`item`, bounded by the monotonic `deadline` (None: unbounded).

    Raises:
        TimeoutError: the deadline passed first (`item` is cancelled).
    """
    if deadline is None:
        return await item
    return await asyncio.wait_for(item, max(deadline - time.monotonic(), 0.0))


class _Source:
    """The attention pool's answer to one request. A resumable stream (`resume`) whose
    rank dies (the call fails, or a rank answers 503) is moved to another rank with
    `StreamResume.next_request`, up to `_RESUME_ATTEMPTS` times; its SSE events pass
    through `StreamResume.observe`."""

    def __init__(
        self, call: Callable[[object], DeploymentResponseGenerator], request: object, resume: StreamResume | None,
        on_resume: Callable[[], None],
    ) -> None:  # fmt: skip
        self._call = call
        self._resume = resume
        self._on_resume = on_resume
        self._attempts = 0
        self.answer = call.remote(request if resume is None else resume.request_for_rank)

    async def next(self) -> ChatChunk | CompletionChunk:
        """The next item.

        Raises:
            StopAsyncIteration: the answer ended.
            Exception: the rank failed and the stream could not be moved.
        """
        while True:
            try:
                item = await anext(self.answer)
                if self._resume is not None and isinstance(item, ErrorResponse) and \
                        item.error.code == HTTPStatus.SERVICE_UNAVAILABLE:  # fmt: skip
                    raise RuntimeError(item.error.message)
            except StopAsyncIteration:
                raise
            except Exception as exc:
                request = self._resume.next_request() if self._resume is not None else None
                if request is None or self._attempts >= _RESUME_ATTEMPTS:
                    raise
                self._attempts += 1
                logger.warning("attention rank failed (%s: %s); resuming the stream on another rank (attempt %d)",
                               type(exc).__name__, exc, self._attempts)  # fmt: skip
                await asyncio.sleep(_RESUME_BACKOFF_S * self._attempts)
                self.answer = self._call.remote(request)
                self._on_resume()
                continue
            return self._resume.observe(item) if self._resume is not None and isinstance(item, str) else item

    def cancel(self) -> None:
        self.answer.cancel()


async def _respond(
    source: _Source, ticket: _Ticket, deadline: float | None, budget_s: float | None, retry_after_s: int
) -> Response:
    """JSON for a single response or error item, SSE for a stream of `str` events;
    `ticket` is given back when the answer ends. Past the monotonic `deadline` the
    request is aborted: 504 before the first item, else an SSE error event. A 503 from
    the attention pool (a draining or failed rank) carries `Retry-After`."""
    try:
        first: ChatChunk | CompletionChunk = await _within(source.next(), deadline)
    except TimeoutError:
        source.cancel()
        ticket.done(expired=True)
        return _error_response(_deadline_error(budget_s))
    except BaseException:
        ticket.done()
        raise
    if not isinstance(first, str):
        ticket.done()
        if not isinstance(first, ErrorResponse):
            return JSONResponse(first.model_dump())
        response = _error_response(first)
        if first.error.code == HTTPStatus.SERVICE_UNAVAILABLE:
            response.headers["Retry-After"] = str(retry_after_s)
        return response
    events = _events(first, source, ticket, deadline, budget_s)
    weakref.finalize(events, ticket.done)
    return StreamingResponse(events, media_type="text/event-stream")


async def _events(
    first: str, source: _Source, ticket: _Ticket, deadline: float | None, budget_s: float | None
) -> AsyncIterator[str]:
    """The SSE events of one stream; if the attention replica fails mid-stream (it
    died, or was killed past its drain timeout) and the stream cannot be resumed on
    another rank, a final SSE error event (503) and `[DONE]` instead of a cut
    connection; past the deadline, a 504 error event."""
    expired = False
    try:
        yield first
        while True:
            try:
                event = await _within(source.next(), deadline)
            except StopAsyncIteration:
                return
            except TimeoutError:
                source.cancel()
                expired = True
                error = _deadline_error(budget_s)
                break
            except Exception as exc:
                logger.exception("stream failed", exc_info=exc)
                error = _error(HTTPStatus.SERVICE_UNAVAILABLE, "the attention rank serving this request failed "
                               f"({type(exc).__name__}); retry it", "ServiceUnavailableError")  # fmt: skip
                break
            if isinstance(event, ErrorResponse):  # a rank's error after the stream began
                error = event
                break
            yield event
        yield f"data: {json.dumps(error.model_dump())}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        ticket.done(expired)


def _materialized(value: object) -> object:
    """`value` with every iterator inside it turned into a list. vLLM's chat message
    types declare content parts and tool calls as `Iterable`, which pydantic keeps as
    lazy validating iterators that cannot be pickled to the attention replica (a list
    of content parts was a 500; found by the fuzz test).

    Raises:
        pydantic.ValidationError: an item of such an iterator does not validate.
    """
    if isinstance(value, dict):
        return {key: _materialized(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_materialized(item) for item in value]
    if isinstance(value, Iterator):
        return [_materialized(item) for item in value]
    return value


def _refused(refusal: Refusal, retry_after_s: int) -> JSONResponse:
    """The 429/503 answer of a refused request, with `Retry-After`."""
    kind = "TooManyRequestsError" if refusal.status == HTTPStatus.TOO_MANY_REQUESTS else "ServiceUnavailableError"
    response = _error_response(_error(refusal.status, refusal.message, kind))
    response.headers["Retry-After"] = str(retry_after_s)
    return response


def _unavailable(message: str, retry_after_s: int) -> JSONResponse:
    """503 with `Retry-After`: the part of the application that would answer is not
    ready or did not answer within `_CALL_S`."""
    return _refused(Refusal(HTTPStatus.SERVICE_UNAVAILABLE, message), retry_after_s)


async def _bounded(call: Awaitable[_T], what: str, within_s: float = _CALL_S) -> _T:
    """`call`'s result within `within_s` seconds.

    Raises:
        TimeoutError: no answer in time (`what` names who did not answer).
    """
    try:
        return await asyncio.wait_for(call, within_s)
    except TimeoutError:
        raise TimeoutError(f"{what} did not answer within {within_s:.0f} s") from None


def _unauthorized(message: str) -> JSONResponse:
    response = _error_response(_error(HTTPStatus.UNAUTHORIZED, message, "AuthenticationError"))
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


def _deadline_s(request: Request) -> float | None:
    """The request's `x-request-deadline-ms` in seconds (None: absent).

    Raises:
        RequestValidationError: not a positive integer (400 naming the header).
    """
    raw = request.headers.get(DEADLINE_HEADER)
    if raw is None:
        return None
    if not (raw.strip().isascii() and raw.strip().isdigit()) or int(raw) <= 0:
        raise RequestValidationError([{"type": "value_error", "loc": ("body", DEADLINE_HEADER),
                                       "msg": f"must be a positive integer of milliseconds, got {raw!r}"}])  # fmt: skip
    return int(raw) / 1e3


@serve.ingress(app)
class Ingress:
    """The HTTP routes of the application (wrap with `serve.deployment` to deploy).

    Inference requests pass access control (`AccessKeys`, 401), then admission
    (`Admission`: 429/503 with `Retry-After`; decided before the body is read, the
    deadline once it is), then go to the attention pool.

    Args:
        attention: handle to the `AttentionServer` deployment (the attention pool).
        coordinator: handle to the `Coordinator` deployment.
        ffn: handle to the `FFNServer` deployment (the FFN pool), for health only;
            no request is ever routed there.
        attention_pool, ffn_pool: the pools' resize bounds (`min_ranks`, `max_ranks`),
            checked on `POST /afd/scale`; `attention_pool.max_num_seqs` for admission.
        ingress: admission bounds and `Retry-After`.
        autoscale: `resize_timeout_s`, which (plus `_CALL_S`) bounds the wait of
            `POST /afd/scale`.
        access: the API and admin keys (read by the app builder from the environment).
    """

    def __init__(
        self,
        attention: DeploymentHandle,
        coordinator: DeploymentHandle,
        ffn: DeploymentHandle,
        attention_pool: AttentionPoolConfig,
        ffn_pool: FFNPoolConfig,
        ingress: IngressConfig,
        autoscale: AutoscaleConfig,
        access: AccessKeys,
    ) -> None:
        self._bounds = {"attention": attention_pool, "ffn": ffn_pool}
        self._attention = attention
        self._attention_stream = attention.options(stream=True)
        self._coordinator = coordinator
        self._ffn = ffn
        self._access = access
        self._retry_after_s = ingress.retry_after_s
        self._body_timeout_s = ingress.body_timeout_s
        self._admission = Admission(ingress, attention_pool.max_num_seqs)
        self._max_num_seqs = attention_pool.max_num_seqs
        self._scale_s = autoscale.resize_timeout_s + _CALL_S
        self._coordinator_answered = time.monotonic()
        """When the coordinator last answered a load read (monotonic seconds)."""
        self._loader = asyncio.get_running_loop().create_task(self._follow_load())

    async def _follow_load(self) -> None:
        """Forever: read the pools' load from the coordinator every `LOAD_PERIOD_S`;
        while the coordinator is unreachable (or restarted and not yet rejoined by the
        members) the last load stays in use."""
        while True:
            try:
                await self._read_load()
            except Exception:
                logger.debug("pool load unavailable", exc_info=True)
            await asyncio.sleep(LOAD_PERIOD_S)

    async def _read_load(self) -> None:
        load: PoolLoad | None = await asyncio.wait_for(self._coordinator.pool_load.remote(), 4 * LOAD_PERIOD_S)
        self._coordinator_answered = time.monotonic()
        if load is not None:
            self._admission.update(load)

    async def _ask(self, method: DeploymentHandle, *args: object, within_s: float = _CALL_S) -> Any:
        """`method.remote(*args)`'s result from the coordinator, within `within_s`.

        Raises:
            TimeoutError: the coordinator has answered none of the load reads
                (`_follow_load`) for `_CALL_S`, so it is down or hung (raised at once,
                no call is made), or it did not answer within `within_s`.
        """
        silent_s = time.monotonic() - self._coordinator_answered
        if silent_s >= _CALL_S:
            raise TimeoutError(f"the coordinator has answered nothing for {silent_s:.0f} s (down or hung)")
        return await _bounded(method.remote(*args), "the coordinator", within_s)

    async def _reserve(self, raw: Request) -> Response | None:
        """Access control, then admission's first step, from `raw`'s headers and the
        admission state this replica holds (read by `_follow_load`; no remote call
        unless no attention rank was ready): the refusal (401, 429/503 with
        `Retry-After`), or None with a place reserved in `raw.state.admitted`.

        Raises:
            RequestValidationError: a bad `x-request-deadline-ms` (400 naming it).
        """
        denied = self._access.denied(raw, Role.USER)
        if denied is not None:
            return _unauthorized(denied)
        budget_s = _deadline_s(raw)
        deadline = None if budget_s is None else time.monotonic() + budget_s
        await self._not_ready()  # reads the load now if no rank was ready
        refusal = self._admission.reserve()
        if refusal is not None:
            return _refused(refusal, self._retry_after_s)
        raw.state.admitted = _Pass(_Ticket(self._admission.release), budget_s, deadline)
        return None

    async def _infer(
        self, raw: Request, call: Callable[[object], DeploymentResponseGenerator], request: object,
        max_tokens: int | None, resume: StreamResume | None = None,
    ) -> Response:  # fmt: skip
        """Admission's second step (the deadline, now that `max_tokens` is known), then
        `call(request)` on the attention pool (moved to another rank if that rank dies,
        for a resumable stream), for a request that holds a place (`_reserve`).

        Raises:
            RequestValidationError: `n` exceeds `attention.max_num_seqs` (400 naming
                `n`): admission counts a request once, so its sequences must fit in one
                attention engine's batch.
        """
        sequences = getattr(request, "n", None) or 1
        if sequences > self._max_num_seqs:
            raise RequestValidationError([{
                "type": "less_than_equal", "loc": ("body", "n"), "input": sequences,
                "msg": f"{sequences} sequences exceed attention.max_num_seqs {self._max_num_seqs}, the sequences "
                "one attention engine runs at once (admission counts a request once)",
            }])  # fmt: skip
        admitted, admission = _pass_of(raw), self._admission
        refusal = admission.admit(admitted.budget_s, max_tokens)
        if refusal is not None:
            admitted.ticket.done()
            return _refused(refusal, self._retry_after_s)
        source = _Source(call, request, resume, admission.resumed)
        return await _respond(source, admitted.ticket, admitted.deadline, admitted.budget_s, self._retry_after_s)

    async def _not_ready(self) -> Refusal | None:
        """Why no request can be served now (no READY attention rank: the application
        is starting, or every attention rank is being replaced), or None."""
        admission = self._admission
        if admission.load is None or admission.load.attention_ranks == 0:
            try:  # just deployed, or every rank was replaced: read the load now, once
                await self._read_load()
            except Exception:
                logger.debug("pool load unavailable", exc_info=True)
        return admission.not_ready()

    @app.get("/v1/models", response_model=None)
    async def models(self, raw: Request) -> ModelList | Response:
        """The served model (OpenAI `GET /v1/models`), from an attention rank; 503 with
        `Retry-After` while none is ready or none answers within `_CALL_S`."""
        denied = self._access.denied(raw, Role.USER)
        if denied is not None:
            return _unauthorized(denied)
        refusal = await self._not_ready()
        if refusal is not None:
            return _refused(refusal, self._retry_after_s)
        try:
            return await _bounded(self._attention.models.remote(), "the attention pool")
        except TimeoutError as exc:
            return _unavailable(str(exc), self._retry_after_s)

    @_inference("/v1/chat/completions")
    async def chat(self, request: ChatCompletionRequest, raw: Request) -> Response:
        """OpenAI chat completions; `stream: true` answers `text/event-stream`."""
        messages = []
        for index, message in enumerate(request.messages):
            try:
                messages.append(_materialized(message))  # a dict (TypedDict) or a pydantic message
            except ValidationError as exc:  # names the message; the key is in the error's own loc
                raise RequestValidationError([error | {"loc": ("body", "messages", index, *error["loc"])}
                                              for error in exc.errors()])  # fmt: skip
        request = request.model_copy(update={"messages": messages})
        max_tokens = request.max_completion_tokens or request.max_tokens
        return await self._infer(raw, self._attention_stream.chat, request, max_tokens)

    @_inference("/v1/completions")
    async def completions(self, request: CompletionRequest, raw: Request) -> Response:
        """OpenAI text completions; `stream: true` answers `text/event-stream`. A
        resumable stream continues on another attention rank if its rank dies
        (`afd_ray.serve.resume`)."""
        resume = StreamResume(request) if StreamResume.possible(request) else None
        return await self._infer(raw, self._attention_stream.completions, request, request.max_tokens, resume)

    @app.get("/health")
    async def health(self) -> Response:
        """200 (empty body) when an attention rank is READY and an attention replica
        and an FFN replica pass their health checks within `_CALL_S` each; else 503
        with `Retry-After` and an error body that says why (e.g. still starting)."""
        refusal = await self._not_ready()
        if refusal is not None:
            return _refused(refusal, self._retry_after_s)
        for pool, handle in (("attention", self._attention), ("FFN", self._ffn)):
            try:
                await _bounded(handle.check_health.remote(), f"the {pool} pool's health check")
            except Exception as exc:
                logger.warning("health check failed: %s: %s", type(exc).__name__, exc)
                return _unavailable(f"{type(exc).__name__}: {exc}", self._retry_after_s)
        return Response(status_code=HTTPStatus.OK)

    # --- AFD control plane ---------------------------------------------------------

    @app.get("/afd/status", response_model=None)
    async def afd_status(self) -> Response:
        """The coordinator's view of both pools (`AFDStatus`), with this ingress
        replica's admission state (`admission`)."""
        try:
            status = await self._ask(self._coordinator.status)
        except TimeoutError as exc:
            return _unavailable(str(exc), self._retry_after_s)
        status = status.model_copy(update={"admission": self._admission.state()})
        return JSONResponse(status.model_dump(mode="json"))

    @app.get("/afd/trace/{request_id}", response_model=None)
    async def afd_trace(self, request_id: str) -> Response:
        """The engine steps of request `request_id` (its OpenAI `id`) split across the
        pools (`afd_ray.observability.steps.TokenBreakdown`), or 404 when no step
        record names it (unknown id, or older than the ring buffers)."""
        try:
            steps = await self._ask(self._coordinator.trace, request_id)
        except TimeoutError as exc:
            return _unavailable(str(exc), self._retry_after_s)
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
        event if it did not complete; 503 with `Retry-After` if the coordinator does
        not answer within `autoscale.resize_timeout_s` + `_CALL_S` (at once when it
        is down: `_ask`). A body that does not fit, or a size outside
        the pool's `min_ranks`..`max_ranks`, is a 400 naming the field. Pauses the
        autoscaler until `POST /afd/autoscale/resume`. An accepted resize runs to its
        end even if the client disconnects; its event is in `/afd/status` `resizes`.
        Needs the admin key when one is set (401)."""
        denied = self._access.denied(request, Role.ADMIN)
        if denied is not None:
            return _unauthorized(denied)
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
        try:
            event = await self._ask(self._coordinator.scale, scale, within_s=self._scale_s)
        except TimeoutError as exc:
            return _unavailable(f"{exc}; a resize it accepted runs to its end: see GET /afd/status `resizes`",
                                self._retry_after_s)  # fmt: skip
        status = HTTPStatus.OK if event.error is None else HTTPStatus.GATEWAY_TIMEOUT
        return JSONResponse(event.model_dump(mode="json"), status_code=status)

    @app.post("/afd/autoscale/policy", response_model=None)
    async def afd_autoscale_policy(self, request: Request) -> Response:
        """Replace the running autoscaling policy with the body, a policy YAML (or
        JSON) document (`afd_ray.autoscale.policy.AutoscalePolicy`). It is validated
        first: a bad document is a 400 naming the field (`param`, and the message)
        and the running policy stays. A deployment started without an autoscaler
        (`autoscale.enabled: false`) runs one from then on; a pause by a manual resize
        stays. Answers the policy now in force, `autoscale_enabled` and
        `autoscale_paused`; 503 with `Retry-After` if the coordinator does not answer
        within `_CALL_S`. Needs the admin key when one is set (401)."""
        denied = self._access.denied(request, Role.ADMIN)
        if denied is not None:
            return _unauthorized(denied)
        try:
            policy = parse_policy((await request.body()).decode(errors="replace"), "body")
        except PolicyError as exc:
            error = ErrorInfo(
                message=str(exc),
                type="BadRequestError",
                param=exc.fields[0] if exc.fields else "body",
                code=HTTPStatus.BAD_REQUEST,
            )
            return _error_response(ErrorResponse(error=error))
        try:
            await self._ask(self._coordinator.set_policy, policy)
            status = await self._ask(self._coordinator.status)
        except TimeoutError as exc:
            return _unavailable(str(exc), self._retry_after_s)
        return JSONResponse(
            {
                "policy": policy.model_dump(mode="json"),
                "autoscale_enabled": status.autoscale_enabled,
                "autoscale_paused": status.autoscale_paused,
            }
        )

    @app.post("/afd/autoscale/resume", response_model=None)
    async def afd_autoscale_resume(self, request: Request) -> Response:
        """Let the autoscaler resize the pools again after a manual resize. The answer
        also says whether the deployment runs an autoscaler at all (`autoscale.enabled`).
        Needs the admin key when one is set (401)."""
        denied = self._access.denied(request, Role.ADMIN)
        if denied is not None:
            return _unauthorized(denied)
        try:
            await self._ask(self._coordinator.resume_autoscaler)
            status = await self._ask(self._coordinator.status)
        except TimeoutError as exc:
            return _unavailable(str(exc), self._retry_after_s)
        return JSONResponse({"autoscale_paused": status.autoscale_paused, "autoscale_enabled": status.autoscale_enabled})
