"""The AFD control plane's HTTP routes (`/afd/*`): the pools' status, a request's step
trace, a manual resize, and the autoscaling policy. The ingress wires the routes
(`afd_ray.serve.ingress`); `Admin` answers them from the coordinator.

Every coordinator call is bounded (`ask`): past its bound the route answers 503 with
`Retry-After`. The routes that change the layout need the admin key when one is set
(401).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray.serve.handle import DeploymentHandle

from afd_ray.autoscale.loader import PolicyError, parse_policy
from afd_ray.config import AttentionPoolConfig, FFNPoolConfig
from afd_ray.config.eplb import EPLBConfig
from afd_ray.control.eplb import check_redundant
from afd_ray.control.membership import AdmissionState, ScaleRequest
from afd_ray.control.placement import check_sizes
from afd_ray.serve.access import AccessKeys, Role
from afd_ray.serve.errors import api_error, error_response, invalid, unauthorized, unavailable

__all__ = ["Admin", "Ask", "RebalanceRequest", "rebalance_request"]

Ask = Callable[..., Awaitable[Any]]
"""`ask(method, *args, within_s=...)`: `method.remote(*args)`'s result from the
coordinator within a bound; raises TimeoutError when it is down or did not answer
(`Ingress._ask`)."""


class RebalanceRequest(BaseModel):
    """Body of `POST /afd/eplb` (optional). Strict: a JSON integer only (`"2"`, `2.0` or
    `true` are errors naming the field, never converted)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    num_redundant_experts: int | None = Field(None, ge=0)
    """Redundant slots per MoE layer of this rebalance's placement, at most
    `ffn.eplb.num_redundant_experts` (`check_redundant`); None: that configured count."""


def rebalance_request(body: bytes, eplb: EPLBConfig) -> int | None:
    """The `num_redundant_experts` a `POST /afd/eplb` body asks for (None: an empty
    body, `{}` or a null count: `eplb`'s own).

    Raises:
        RequestValidationError: not a JSON object of `RebalanceRequest`, or a count over
            `eplb.num_redundant_experts` (a 400 naming the field: `_invalid_body`).
    """
    if not body.strip():
        return None
    try:
        asked = RebalanceRequest.model_validate_json(body).num_redundant_experts
    except ValidationError as exc:
        raise RequestValidationError([error | {"loc": ("body", *error["loc"])} for error in exc.errors()]) from None
    if asked is not None:
        try:
            check_redundant(asked, eplb)
        except ValueError as exc:
            raise invalid("num_redundant_experts", str(exc).partition(": ")[2], "less_than_equal", asked) from None
    return asked


class Admin:
    """The `/afd/*` routes of one ingress replica.

    Args:
        coordinator: handle to the `Coordinator` deployment.
        ask: the bounded coordinator call.
        access: the admin key (`Role.ADMIN`).
        attention_pool, ffn_pool: the pools' resize bounds (`min_ranks`, `max_ranks`).
        retry_after_s: `Retry-After` of a 503, seconds.
        scale_s: the bound on `POST /afd/scale`'s coordinator call, seconds.
    """

    def __init__(
        self,
        coordinator: DeploymentHandle,
        ask: Ask,
        access: AccessKeys,
        attention_pool: AttentionPoolConfig,
        ffn_pool: FFNPoolConfig,
        retry_after_s: int,
        scale_s: float,
    ) -> None:
        self._coordinator = coordinator
        self._ask = ask
        self._access = access
        self._pools = (attention_pool, ffn_pool)
        self._retry_after_s = retry_after_s
        self._scale_s = scale_s

    async def status(self, admission: AdmissionState) -> Response:
        """`GET /afd/status`: the coordinator's view of both pools (`AFDStatus`), with
        this ingress replica's `admission`."""
        try:
            status = await self._ask(self._coordinator.status)
        except TimeoutError as exc:
            return unavailable(str(exc), self._retry_after_s)
        status = status.model_copy(update={"admission": admission})
        return JSONResponse(status.model_dump(mode="json"))

    async def trace(self, request_id: str) -> Response:
        """`GET /afd/trace/{request_id}`: the engine steps of request `request_id` (its
        OpenAI `id`) split across the pools (`afd_ray.observability.steps.TokenBreakdown`),
        or 404 when no step record names it (unknown id, or older than the ring buffers)."""
        try:
            steps = await self._ask(self._coordinator.trace, request_id)
        except TimeoutError as exc:
            return unavailable(str(exc), self._retry_after_s)
        if not steps:
            message = (
                f"request_id: no step record names {request_id!r} (unknown, or evicted from the "
                "observability.step_records ring buffers)"
            )
            return error_response(api_error(HTTPStatus.NOT_FOUND, message, "NotFoundError", "request_id"))
        return JSONResponse({"request_id": request_id, "steps": [step.model_dump(mode="json") for step in steps]})

    async def scale(self, request: Request) -> Response:
        """`POST /afd/scale`: resize the pools to the body's `{"attention": int, "ffn":
        int}` and answer once the new layout serves, with the `ResizeEvent` (200), or
        504 with the event if it did not complete; 503 with `Retry-After` if the
        coordinator does not answer within `scale_s` (at once when it is down). A
        body that does not fit, or a size outside the pool's `min_ranks`..`max_ranks`
        (`check_sizes`), is a 400 naming the field. Pauses the autoscaler until
        `POST /afd/autoscale/resume`. An accepted resize runs to its end even if the
        client disconnects; its event is in `/afd/status` `resizes`."""
        denied = self._access.denied(request, Role.ADMIN)
        if denied is not None:
            return unauthorized(denied)
        try:
            body = await request.json()
        except ValueError:
            raise invalid(0, "invalid JSON", "json_invalid") from None
        try:
            scale = ScaleRequest.model_validate(body)
        except ValidationError as exc:
            raise RequestValidationError([error | {"loc": ("body", *error["loc"])} for error in exc.errors()]) from None
        try:
            check_sizes(scale.attention, scale.ffn, *self._pools)
        except ValueError as exc:  # its message begins with the field: "attention: 9 is outside [1, 4] (...)"
            field = str(exc).partition(":")[0]
            return error_response(api_error(HTTPStatus.BAD_REQUEST, str(exc), "BadRequestError", field))
        try:
            event = await self._ask(self._coordinator.scale, scale, within_s=self._scale_s)
        except TimeoutError as exc:
            message = f"{exc}; a resize it accepted runs to its end: see GET /afd/status `resizes`"
            return unavailable(message, self._retry_after_s)
        status = HTTPStatus.OK if event.error is None else HTTPStatus.GATEWAY_TIMEOUT
        return JSONResponse(event.model_dump(mode="json"), status_code=status)

    async def eplb(self, request: Request) -> Response:
        """`POST /afd/eplb`: rebalance the expert placement over the FFN ranks now
        (`afd_ray.control.eplb`) and answer once it serves, with the `EPLBEvent`: 200
        (`epoch` null: no layer would gain `ffn.eplb.min_gain`), or 409 with the event's
        `error` (no expert load yet, a resize under way, the switch failed); 503 with
        `Retry-After` if the coordinator does not answer within `scale_s`. The body is
        optional: `{"num_redundant_experts": R}` (`RebalanceRequest`); a bad one is a
        400 naming the field (`rebalance_request`)."""
        denied = self._access.denied(request, Role.ADMIN)
        if denied is not None:
            return unauthorized(denied)
        redundant = rebalance_request(await request.body(), self._pools[1].eplb)
        try:
            event = await self._ask(self._coordinator.rebalance_experts, redundant, within_s=self._scale_s)
        except TimeoutError as exc:
            return unavailable(f"{exc}; see GET /afd/status `eplb.rebalances`", self._retry_after_s)
        status = HTTPStatus.OK if event.error is None else HTTPStatus.CONFLICT
        return JSONResponse(event.model_dump(mode="json"), status_code=status)

    async def set_policy(self, request: Request) -> Response:
        """`POST /afd/autoscale/policy`: replace the running autoscaling policy with the
        body, a policy YAML (or JSON) document (`afd_ray.autoscale.schema.AutoscalePolicy`).
        It is validated first: a bad document is a 400 naming the field (`param`, and
        the message) and the running policy stays. A deployment started without an
        autoscaler (`autoscale.enabled: false`) runs one from then on; a pause by a
        manual resize stays. Answers the policy now in force, `autoscale_enabled` and
        `autoscale_paused`."""
        denied = self._access.denied(request, Role.ADMIN)
        if denied is not None:
            return unauthorized(denied)
        try:
            policy = parse_policy((await request.body()).decode(errors="replace"), "body")
        except PolicyError as exc:
            param = exc.fields[0] if exc.fields else "body"
            return error_response(api_error(HTTPStatus.BAD_REQUEST, str(exc), "BadRequestError", param))
        try:
            await self._ask(self._coordinator.set_policy, policy)
            status = await self._ask(self._coordinator.status)
        except TimeoutError as exc:
            return unavailable(str(exc), self._retry_after_s)
        return JSONResponse(
            {
                "policy": policy.model_dump(mode="json"),
                "autoscale_enabled": status.autoscale_enabled,
                "autoscale_paused": status.autoscale_paused,
            }
        )

    async def resume_autoscaler(self, request: Request) -> Response:
        """`POST /afd/autoscale/resume`: let the autoscaler resize the pools again after
        a manual resize. The answer also says whether the deployment runs an
        autoscaler at all (`autoscale.enabled`)."""
        denied = self._access.denied(request, Role.ADMIN)
        if denied is not None:
            return unauthorized(denied)
        try:
            await self._ask(self._coordinator.resume_autoscaler)
            status = await self._ask(self._coordinator.status)
        except TimeoutError as exc:
            return unavailable(str(exc), self._retry_after_s)
        return JSONResponse(
            {"autoscale_paused": status.autoscale_paused, "autoscale_enabled": status.autoscale_enabled}
        )
