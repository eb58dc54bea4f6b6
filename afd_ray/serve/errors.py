"""Every error the ingress sends, in OpenAI's envelope:
`{"error": {"message", "type", "param", "code"}}`, with `param` naming the field and
`code` equal to the HTTP status: as a JSON response, or as the SSE event that ends a
stream (`sse_error`, the one place an error is framed as SSE).

`add_handlers` installs FastAPI's exception handlers that give this shape to a body
that does not validate, FastAPI's own HTTP errors, vLLM's request errors and
anything else (500).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from afd_ray.compat import VLLM_REQUEST_ERRORS, ErrorInfo, ErrorResponse, clean_loc_for_param, create_error_response
from afd_ray.serve.admission import DEADLINE_HEADER, Refusal

__all__ = [
    "add_handlers",
    "api_error",
    "deadline_error",
    "error_response",
    "invalid",
    "refused",
    "sse_error",
    "unauthorized",
    "unavailable",
]

logger = logging.getLogger(__name__)

_TYPE_MISMATCHES = frozenset({"none_required", "literal_error", "is_instance_of", "union_tag_invalid"})
"""Pydantic error types (besides `*_type` and `*_parsing`) that say only that the
value is not of a union member's type."""


def api_error(status: int, message: str, kind: str, param: str | None = None) -> ErrorResponse:
    """An OpenAI error body: `kind` is its `type` (e.g. `BadRequestError`)."""
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=status))


def error_response(error: ErrorResponse) -> JSONResponse:
    """`error` as a JSON response with its status."""
    return JSONResponse(error.model_dump(), status_code=error.error.code)


def sse_error(error: ErrorResponse) -> str:
    """`error` as the SSE event that ends a stream (vLLM writes its own the same way)."""
    return f"data: {json.dumps(error.model_dump())}\n\n"


def invalid(field: str | int, message: str, kind: str = "value_error", value: object = None) -> RequestValidationError:
    """The 400 of a request field (`loc` `("body", field)`) that FastAPI could not
    check itself, shaped like FastAPI's own (`_invalid_body` names the field)."""
    return RequestValidationError([{"type": kind, "loc": ("body", field), "msg": message, "input": value}])


def refused(refusal: Refusal, retry_after_s: int) -> JSONResponse:
    """The 429/503 answer of a refused request, with `Retry-After`."""
    kind = "TooManyRequestsError" if refusal.status == HTTPStatus.TOO_MANY_REQUESTS else "ServiceUnavailableError"
    response = error_response(api_error(refusal.status, refusal.message, kind))
    response.headers["Retry-After"] = str(retry_after_s)
    return response


def unavailable(message: str, retry_after_s: int) -> JSONResponse:
    """503 with `Retry-After`: the part of the application that would answer is not
    ready or did not answer in time."""
    return refused(Refusal(HTTPStatus.SERVICE_UNAVAILABLE, message), retry_after_s)


def unauthorized(message: str) -> JSONResponse:
    """401 with `WWW-Authenticate: Bearer` (`afd_ray.serve.access`)."""
    response = error_response(api_error(HTTPStatus.UNAUTHORIZED, message, "AuthenticationError"))
    response.headers["WWW-Authenticate"] = "Bearer"
    return response


def deadline_error(deadline_s: float) -> ErrorResponse:
    """The 504 of a request aborted at its `x-request-deadline-ms` (`deadline_s` seconds)."""
    message = f"{DEADLINE_HEADER}: the request did not finish within {deadline_s * 1e3:.0f} ms; it was aborted"
    return api_error(HTTPStatus.GATEWAY_TIMEOUT, message, "DeadlineExceededError", DEADLINE_HEADER)


def add_handlers(app: FastAPI) -> None:
    """Give every error `app` raises the OpenAI shape."""
    app.add_exception_handler(RequestValidationError, _invalid_body)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    for error in VLLM_REQUEST_ERRORS:
        app.add_exception_handler(error, _vllm_error)
    app.add_exception_handler(Exception, _internal_error)


async def _invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
    """A body that is not JSON, or does not fit vLLM's request model: 400 naming the
    field (the most specific of its errors: `_most_specific`)."""
    first = _most_specific(exc.errors())
    # loc is ("body", field, ...); for malformed JSON it is ("body", offset).
    field = first["loc"][1:] if first["type"] != "json_invalid" else ()
    param = clean_loc_for_param(field) if field else "body"
    more = f" (and {len(exc.errors()) - 1} more errors)" if len(exc.errors()) > 1 else ""
    return error_response(api_error(HTTPStatus.BAD_REQUEST, f"{param}: {first['msg']}{more}", "BadRequestError", param))


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


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own HTTP errors (a body it cannot even parse, e.g. invalid UTF-8; an
    unknown route; a wrong method) in the OpenAI error shape, same status."""
    bad = exc.status_code == HTTPStatus.BAD_REQUEST
    kind = "BadRequestError" if bad else HTTPStatus(exc.status_code).phrase
    return error_response(api_error(exc.status_code, str(exc.detail), kind, "body" if bad else None))


async def _vllm_error(_: Request, exc: Exception) -> JSONResponse:
    """A check inside vLLM's request models (e.g. no `prompt`): vLLM's own status."""
    return error_response(create_error_response(exc))


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    """Anything else (a replica died, a bug): 500 with an OpenAI error body."""
    logger.exception("request failed", exc_info=exc)
    message = f"{type(exc).__name__}: internal error"
    return error_response(api_error(HTTPStatus.INTERNAL_SERVER_ERROR, message, "InternalServerError"))
