"""Admission at the HTTP edge of an inference route: access control (401) and
admission's first step (429/503 with `Retry-After`: `afd_ray.serve.admission`
decides) on a request's headers alone, before its body is read and parsed; then the
body, within `ingress.body_timeout_s` (408).

A refusal needs no body: through Serve's Python proxy the body came by another call,
and under a burst a refusal that waited for it took 76 ms more, median, loaded 2-core
machine; with direct ingress it comes from the connection. FastAPI reads a route's
body before it solves the route's dependencies, so the gate wraps the route's
handler instead (`admitted_route`, FastAPI's custom `APIRoute`). An admitted route
finds its place in the count (`Pass`) with `pass_of(request)`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus

from fastapi import Request
from fastapi.responses import Response
from fastapi.routing import APIRoute

from afd_ray.serve.access import AccessKeys, Role
from afd_ray.serve.admission import DEADLINE_HEADER, Admission, Refusal
from afd_ray.serve.errors import api_error, error_response, invalid, refused, unauthorized

__all__ = ["Gate", "Pass", "Ticket", "admitted_route", "pass_of"]


class Ticket:
    """One admitted request's place in the admission count, given back exactly once:
    when its answer ends, or when its unstarted SSE body is dropped (the client left
    before the first event was sent).

    Args:
        release: `Admission.release`; its argument says whether the deadline ended the answer.
    """

    def __init__(self, release: Callable[[bool], None]) -> None:
        self._release: Callable[[bool], None] | None = release

    def done(self, expired: bool = False) -> None:
        if self._release is not None:
            release, self._release = self._release, None
            release(expired)


@dataclass(frozen=True)
class Pass:
    """What the gate hands an inference route whose request holds a place."""

    ticket: Ticket
    """The place (`Admission.reserve`), given back when the answer ends."""
    budget_s: float | None
    """`x-request-deadline-ms` in seconds (None: no deadline)."""
    deadline: float | None
    """The monotonic time the answer must end by (None: no deadline)."""


class Gate:
    """The gate of one ingress replica's inference routes.

    Args:
        access: the API key (`Role.USER`).
        admission: this replica's admission state.
        not_ready: reads the pools' load now if no attention rank was ready (a remote
            call only then), and says why no request can be served (or None).
        retry_after_s: `Retry-After` of a refusal, seconds.
        body_timeout_s: `ingress.body_timeout_s`.
    """

    def __init__(
        self,
        access: AccessKeys,
        admission: Admission,
        not_ready: Callable[[], Awaitable[Refusal | None]],
        retry_after_s: int,
        body_timeout_s: float,
    ) -> None:
        self._access = access
        self._admission = admission
        self._not_ready = not_ready
        self._retry_after_s = retry_after_s
        self._body_timeout_s = body_timeout_s

    async def enter(self, request: Request) -> Response | None:
        """Reserve a place for `request` and read its body: the refusal (401,
        429/503, or 408 when the body does not arrive in time; the place is then
        given back), or None with the place in `request.state` (`pass_of`). A client
        that goes away mid-body gives the place back too (the error propagates).

        Raises:
            RequestValidationError: a bad `x-request-deadline-ms` (400 naming it).
        """
        denied = self._access.denied(request, Role.USER)
        if denied is not None:
            return unauthorized(denied)
        budget_s = _deadline_s(request)
        deadline = None if budget_s is None else time.monotonic() + budget_s
        await self._not_ready()  # reads the load now if no rank was ready
        refusal = self._admission.reserve()
        if refusal is not None:
            return refused(refusal, self._retry_after_s)
        ticket = Ticket(self._admission.release)
        request.state.admitted = Pass(ticket, budget_s, deadline)
        try:
            await asyncio.wait_for(request.body(), self._body_timeout_s)  # cached for the handler
        except TimeoutError:
            ticket.done()
            message = (
                f"body: the request body did not arrive within {self._body_timeout_s:g} s (ingress.body_timeout_s)"
            )
            return error_response(api_error(HTTPStatus.REQUEST_TIMEOUT, message, "RequestTimeoutError", "body"))
        except BaseException:  # the client went away mid-body (ClientDisconnect), or cancelled
            ticket.done()
            raise
        return None


def admitted_route(gate: Callable[[], Gate]) -> type[APIRoute]:
    """A route class whose requests pass `gate()` (the serving replica's gate) before
    FastAPI reads their body; the place is given back if the route fails (e.g. a body
    that does not validate: 400)."""

    class AdmittedRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
            handler = super().get_route_handler()

            async def admitted(request: Request) -> Response:
                refusal = await gate().enter(request)
                if refusal is not None:
                    return refusal
                try:
                    return await handler(request)
                except BaseException:
                    pass_of(request).ticket.done()
                    raise

            return admitted

    return AdmittedRoute


def pass_of(request: Request) -> Pass:
    """The place of a request that passed the gate."""
    admitted: Pass = request.state.admitted
    return admitted


def _deadline_s(request: Request) -> float | None:
    """The request's `x-request-deadline-ms` in seconds (None: absent).

    Raises:
        RequestValidationError: not a positive integer (400 naming the header).
    """
    raw = request.headers.get(DEADLINE_HEADER)
    if raw is None:
        return None
    if not (raw.strip().isascii() and raw.strip().isdigit()) or int(raw) <= 0:
        raise invalid(DEADLINE_HEADER, f"must be a positive integer of milliseconds, got {raw!r}")
    return int(raw) / 1e3
