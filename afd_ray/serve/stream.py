"""The attention pool's answer to one admitted request, relayed to the client: JSON
for a whole response or error, SSE for a stream (framed here, once, from the typed
items of `afd_ray.attention.chunks`).

A resumable stream (`afd_ray.serve.resume`) whose rank dies is moved to another rank
(`Source`); a stream that fails otherwise ends with an SSE error event and `[DONE]`
instead of a cut connection; an answer past its deadline is aborted (504, or an SSE
error event).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from typing import TypeVar

from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray.serve.handle import DeploymentResponseGenerator

from afd_ray.attention.chunks import ChatChunk, CompletionChunk, StreamError, StreamEvent
from afd_ray.compat import ErrorResponse
from afd_ray.serve.errors import api_error, deadline_error, error_response, sse_error
from afd_ray.serve.gate import Pass
from afd_ray.serve.resume import StreamResume

__all__ = ["Source", "respond"]

logger = logging.getLogger(__name__)

_RESUME_ATTEMPTS = 5
"""Times a resumable stream is moved to another attention rank before it ends with an
error (Serve may route a retry to the dead replica until it is replaced)."""
_RESUME_BACKOFF_S = 0.5
"""Wait before the k-th move: k x this, seconds."""
_DONE = "data: [DONE]\n\n"
"""The last SSE event of every stream."""
_T = TypeVar("_T")


class Source:
    """The attention pool's answer to one request: `call.remote(request)`. A
    resumable stream (`resume`) whose rank dies (the call fails, or a rank answers
    503) is moved to another rank with `StreamResume.next_request`, up to
    `_RESUME_ATTEMPTS` times (`on_resume` counts each move), or ends as usual if the
    client already has the whole answer (`StreamResume.complete`); its events pass
    through `StreamResume.observe`."""

    def __init__(
        self,
        call: Callable[[object], DeploymentResponseGenerator],
        request: object,
        resume: StreamResume | None,
        on_resume: Callable[[], None],
    ) -> None:
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
                if self._resume is not None and isinstance(item, ErrorResponse):
                    if item.error.code == HTTPStatus.SERVICE_UNAVAILABLE:
                        raise RuntimeError(item.error.message)
            except StopAsyncIteration:
                raise
            except Exception as exc:
                if self._resume is not None and self._resume.complete:
                    # the rank died after the answer's last token, before its stream
                    # ended: the client has it all (a usage chunk still to come is lost)
                    logger.info("attention rank failed after the whole answer (%s); ending the stream", exc)
                    raise StopAsyncIteration from None
                request = self._resume.next_request() if self._resume is not None else None
                if request is None or self._attempts >= _RESUME_ATTEMPTS:
                    raise
                self._attempts += 1
                logger.warning(
                    "attention rank failed (%s: %s); resuming the stream on another rank (attempt %d)",
                    type(exc).__name__,
                    exc,
                    self._attempts,
                )
                await asyncio.sleep(_RESUME_BACKOFF_S * self._attempts)
                self.answer = self._call.remote(request)
                self._on_resume()
                continue
            return self._resume.observe(item) if self._resume is not None and isinstance(item, StreamEvent) else item

    def cancel(self) -> None:
        self.answer.cancel()


async def respond(source: Source, admitted: Pass, retry_after_s: int) -> Response:
    """JSON for a whole response or error item, SSE for a stream; `admitted.ticket`
    is given back when the answer ends. Past `admitted.deadline` the request is
    aborted: 504 before the first item, else an SSE error event. A 503 from the
    attention pool (a draining or failed rank) carries `Retry-After`, and so does the
    503 of a request whose rank died before its first item and that could not move
    (a non-streaming one; it was a 500 before)."""
    ticket = admitted.ticket
    try:
        first = await _within(source.next(), admitted.deadline)
    except TimeoutError:
        source.cancel()
        ticket.done(expired=True)
        return error_response(deadline_error(admitted.budget_s))
    except StopAsyncIteration:
        ticket.done()
        raise
    except Exception as exc:  # the rank died before answering, and the request could not move
        ticket.done()
        logger.warning("attention rank failed before answering: %s: %s", type(exc).__name__, exc)
        first = _rank_failed(exc)
    except BaseException:
        ticket.done()
        raise
    if not isinstance(first, StreamEvent | StreamError):
        ticket.done()
        if not isinstance(first, ErrorResponse):
            return JSONResponse(first.model_dump())
        response = error_response(first)
        if first.error.code == HTTPStatus.SERVICE_UNAVAILABLE:
            response.headers["Retry-After"] = str(retry_after_s)
        return response
    events = _events(first, source, admitted)
    weakref.finalize(events, ticket.done)
    return StreamingResponse(events, media_type="text/event-stream")


async def _events(first: StreamEvent | StreamError, source: Source, admitted: Pass) -> AsyncIterator[str]:
    """The SSE events of one stream, then `[DONE]`; if the attention replica fails
    mid-stream (it died, or was killed past its drain timeout) and the stream cannot
    be resumed on another rank, a final SSE error event (503) before it instead of a
    cut connection; past the deadline, a 504 error event."""
    expired = False
    item: ChatChunk | CompletionChunk = first
    try:
        while True:
            if isinstance(item, StreamError):  # vLLM's error during generation, or the drain timeout
                yield sse_error(item.error)
                break
            if isinstance(item, ErrorResponse):  # a rank's error after the stream began (a resumed stream)
                yield sse_error(item)
                break
            yield f"data: {item.payload.model_dump_json(exclude_unset=True)}\n\n"  # the keys vLLM wrote
            try:
                item = await _within(source.next(), admitted.deadline)
            except StopAsyncIteration:
                break
            except TimeoutError:
                source.cancel()
                expired = True
                yield sse_error(deadline_error(admitted.budget_s))
                break
            except Exception as exc:
                logger.exception("stream failed", exc_info=exc)
                yield sse_error(_rank_failed(exc))
                break
        yield _DONE
    finally:
        admitted.ticket.done(expired)


def _rank_failed(exc: Exception) -> ErrorResponse:
    """The 503 of a request whose attention rank failed (`exc`: e.g. Ray's
    `ActorDiedError`) and that could not move to another rank."""
    message = f"the attention rank serving this request failed ({type(exc).__name__}); retry it"
    return api_error(HTTPStatus.SERVICE_UNAVAILABLE, message, "ServiceUnavailableError")


async def _within(item: Awaitable[_T], deadline: float | None) -> _T:
    """`item`, bounded by the monotonic `deadline` (None: unbounded).

    Raises:
        TimeoutError: the deadline passed first (`item` is cancelled).
    """
    if deadline is None:
        return await item
    return await asyncio.wait_for(item, max(deadline - time.monotonic(), 0.0))
