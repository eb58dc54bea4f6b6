"""The OpenAI-compatible HTTP front: the routes of the application, wired to the
parts that answer them.

Requests are parsed into vLLM's own protocol models (`afd_ray.serve.protocol`), so
the accepted fields and their checks are exactly vLLM's; every error leaves in
OpenAI's shape (`afd_ray.serve.errors`); the replicas are never disturbed by bad
input. An inference request passes access control and admission (`afd_ray.serve.gate`,
before its body is read), then goes to the attention pool and its answer is relayed
as JSON or SSE (`afd_ray.serve.stream`); an optional `x-request-deadline-ms` header
bounds its whole answer (504, or an SSE error event, once it passes). The `/afd/*`
routes are `afd_ray.serve.admin`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from afd_ray.compat import ModelList
from afd_ray.config import AttentionPoolConfig, AutoscaleConfig, FFNPoolConfig, IngressConfig
from afd_ray.control.membership import PoolLoad
from afd_ray.serve.access import AccessKeys, Role
from afd_ray.serve.admin import Admin
from afd_ray.serve.admission import LOAD_PERIOD_S, Admission, Refusal
from afd_ray.serve.errors import add_handlers, invalid, refused, unauthorized, unavailable
from afd_ray.serve.gate import Gate, admitted_route, pass_of
from afd_ray.serve.protocol import ChatCompletionRequest, CompletionRequest, materialized
from afd_ray.serve.resume import StreamResume
from afd_ray.serve.stream import Source, respond

__all__ = ["Ingress", "app"]

logger = logging.getLogger(__name__)

app = FastAPI(title="afd_ray", summary="OpenAI-compatible API of an AFD deployment")
add_handlers(app)

_T = TypeVar("_T")
_Endpoint = TypeVar("_Endpoint", bound=Callable[..., Awaitable[Response]])
_CALL_S = 10.0
"""Bound on a call of a route that is not inference (health, model list, status) to
a pool member or the coordinator, seconds: a Serve handle call waits for a running
replica without bound (an attention rank still starting, a hung coordinator), so past
this the route answers 503 with `Retry-After` instead of hanging. A coordinator that
has answered none of the ingress's load reads for this long is taken as down: its
routes answer 503 at once (`Ingress._ask`)."""

_AdmittedRoute = admitted_route(lambda: serve.get_replica_context().servable_object.gate)
"""The inference routes' class: the serving replica's `Ingress.gate` first (found as
Serve finds `self` for a route method)."""


def _inference(path: str) -> Callable[[_Endpoint], _Endpoint]:
    """Register `POST path` as an admitted route of `app` (as `app.post` would)."""

    def register(endpoint: _Endpoint) -> _Endpoint:
        app.router.add_api_route(
            path, endpoint, methods=["POST"], response_model=None, route_class_override=_AdmittedRoute
        )
        return endpoint

    return register


async def _bounded(call: Awaitable[_T], what: str, within_s: float = _CALL_S) -> _T:
    """`call`'s result within `within_s` seconds.

    Raises:
        TimeoutError: no answer in time (`what` names who did not answer).
    """
    try:
        return await asyncio.wait_for(call, within_s)
    except TimeoutError:
        raise TimeoutError(f"{what} did not answer within {within_s:.0f} s") from None


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
        self._attention = attention
        self._attention_stream = attention.options(stream=True)
        self._coordinator = coordinator
        self._ffn = ffn
        self._access = access
        self._retry_after_s = ingress.retry_after_s
        self._admission = Admission(ingress, attention_pool.max_num_seqs)
        self._max_num_seqs = attention_pool.max_num_seqs
        self.gate = Gate(access, self._admission, self._not_ready, ingress.retry_after_s, ingress.body_timeout_s)
        """The inference routes' access control and admission (`_AdmittedRoute`)."""
        scale_s = autoscale.resize_timeout_s + _CALL_S
        self._admin = Admin(coordinator, self._ask, access, attention_pool, ffn_pool, ingress.retry_after_s, scale_s)
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

    async def _infer(
        self,
        raw: Request,
        call: Callable[[object], DeploymentResponseGenerator],
        request: object,
        max_tokens: int | None,
        resume: StreamResume | None = None,
    ) -> Response:
        """Admission's second step (the deadline, now that `max_tokens` is known), then
        `call(request)` on the attention pool (moved to another rank if that rank dies,
        for a resumable stream), for a request that passed the gate.

        Raises:
            RequestValidationError: `n` exceeds `attention.max_num_seqs` (400 naming
                `n`): admission counts a request once, so its sequences must fit in one
                attention engine's batch.
        """
        sequences = getattr(request, "n", None) or 1
        if sequences > self._max_num_seqs:
            message = (
                f"{sequences} sequences exceed attention.max_num_seqs {self._max_num_seqs}, the sequences "
                "one attention engine runs at once (admission counts a request once)"
            )
            raise invalid("n", message, "less_than_equal", sequences)
        admitted, admission = pass_of(raw), self._admission
        refusal = admission.admit(admitted.budget_s, max_tokens)
        if refusal is not None:
            admitted.ticket.done()
            return refused(refusal, self._retry_after_s)
        return await respond(Source(call, request, resume, admission.resumed), admitted, self._retry_after_s)

    @app.get("/v1/models", response_model=None)
    async def models(self, raw: Request) -> ModelList | Response:
        """The served model (OpenAI `GET /v1/models`), from an attention rank; 503 with
        `Retry-After` while none is ready or none answers within `_CALL_S`."""
        denied = self._access.denied(raw, Role.USER)
        if denied is not None:
            return unauthorized(denied)
        refusal = await self._not_ready()
        if refusal is not None:
            return refused(refusal, self._retry_after_s)
        try:
            return await _bounded(self._attention.models.remote(), "the attention pool")
        except TimeoutError as exc:
            return unavailable(str(exc), self._retry_after_s)

    @_inference("/v1/chat/completions")
    async def chat(self, request: ChatCompletionRequest, raw: Request) -> Response:
        """OpenAI chat completions; `stream: true` answers `text/event-stream`."""
        request = materialized(request)
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
            return refused(refusal, self._retry_after_s)
        for pool, handle in (("attention", self._attention), ("FFN", self._ffn)):
            try:
                await _bounded(handle.check_health.remote(), f"the {pool} pool's health check")
            except Exception as exc:
                logger.warning("health check failed: %s: %s", type(exc).__name__, exc)
                return unavailable(f"{type(exc).__name__}: {exc}", self._retry_after_s)
        return Response(status_code=HTTPStatus.OK)

    # --- AFD control plane (afd_ray.serve.admin) -------------------------------------

    @app.get("/afd/status", response_model=None)
    async def afd_status(self) -> Response:
        """The coordinator's view of both pools, with this replica's admission state (`Admin.status`)."""
        return await self._admin.status(self._admission.state())

    @app.get("/afd/trace/{request_id}", response_model=None)
    async def afd_trace(self, request_id: str) -> Response:
        """The engine steps of one request across the pools (`Admin.trace`)."""
        return await self._admin.trace(request_id)

    @app.post("/afd/scale", response_model=None)
    async def afd_scale(self, request: Request) -> Response:
        """Resize the pools; needs the admin key when one is set (`Admin.scale`)."""
        return await self._admin.scale(request)

    @app.post("/afd/eplb", response_model=None)
    async def afd_eplb(self, request: Request) -> Response:
        """Rebalance the experts over the FFN ranks now; needs the admin key when one is set (`Admin.eplb`)."""
        return await self._admin.eplb(request)

    @app.post("/afd/autoscale/policy", response_model=None)
    async def afd_autoscale_policy(self, request: Request) -> Response:
        """Replace the autoscaling policy; needs the admin key when one is set (`Admin.set_policy`)."""
        return await self._admin.set_policy(request)

    @app.post("/afd/autoscale/resume", response_model=None)
    async def afd_autoscale_resume(self, request: Request) -> Response:
        """Let the autoscaler resize again; needs the admin key when one is set (`Admin.resume_autoscaler`)."""
        return await self._admin.resume_autoscaler(request)
