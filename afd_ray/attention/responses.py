"""What an attention rank answers for one request, from vLLM's OpenAI serving layer:
its result turned into typed items (`afd_ray.attention.chunks`), error bodies that
name the request field, and the 503 bodies of a failed or draining rank.

vLLM's serving layer hands out a stream only as SSE text (it frames
`chunk.model_dump_json(...)` itself), so that text is read back here, once per
event (`_typed`); from here on a stream is typed, and SSE is framed once, at the
ingress (`afd_ray.serve.stream`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Collection
from typing import TypeVar

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionStreamResponse
from vllm.entrypoints.openai.completion.protocol import CompletionStreamResponse

from afd_ray.attention.chunks import StreamError, StreamEvent
from afd_ray.compat import ErrorInfo, ErrorResponse, create_error_response

__all__ = ["drain_error", "engine_failed", "error_of", "prompt_token_ids", "relay", "until_drained"]

logger = logging.getLogger(__name__)

_Item = TypeVar("_Item")
_DONE = "[DONE]"
"""vLLM's last SSE event's data; the ingress sends its own."""


async def relay(
    answer: Awaitable[object],
    fields: Collection[str],
    stream: type[ChatCompletionStreamResponse] | type[CompletionStreamResponse],
) -> AsyncGenerator[object, None]:
    """The items of one vLLM serving call (`create_chat_completion`,
    `create_completion`): a `StreamEvent` per event (payload of type `stream`, ended
    by a `StreamError` if generation failed) when it streams, else the one response
    or error body; an exception becomes an error body. An error body names the
    request field (one of `fields`) its message begins with (`_naming_the_field`)."""
    try:
        result = await answer
    except Exception as exc:  # noqa: BLE001 - every failure becomes an error body
        yield _naming_the_field(error_of(exc), fields)
        return
    if isinstance(result, AsyncIterator):
        async for event in result:
            item = _typed(event, stream)
            if item is not None:
                yield item
    elif isinstance(result, ErrorResponse):
        yield _naming_the_field(result, fields)
    else:
        yield result


def _typed(
    event: str, stream: type[ChatCompletionStreamResponse] | type[CompletionStreamResponse]
) -> StreamEvent | StreamError | None:
    """One SSE event of vLLM (`"data: {...}\\n\\n"`) as an item: its chunk, its error
    body, or None for `[DONE]`. The chunk's set fields are the keys vLLM wrote, so
    `model_dump_json(exclude_unset=True)` writes vLLM's JSON again."""
    data = event.removeprefix("data: ").rstrip("\n")
    if data == _DONE:
        return None
    body = json.loads(data)
    if "error" in body:
        return StreamError(ErrorResponse.model_validate(body))
    return StreamEvent(stream.model_validate(body))


async def until_drained(
    items: AsyncGenerator[_Item, None],
    draining: asyncio.Event,
    drained: asyncio.Event,
    error: Callable[[], ErrorResponse],
) -> AsyncGenerator[_Item | StreamError | ErrorResponse, None]:
    """The items of `items` until `drained` is set (`draining` is set before it);
    then the request is aborted in vLLM (`items` is closed) and ends with `error()`
    (`drain_error`): as the whole answer if nothing was streamed yet, else as a
    `StreamError`."""
    streamed = False
    try:
        while not drained.is_set():
            if not draining.is_set():  # serving: no race, no extra task per item
                try:
                    value = await anext(items)
                except StopAsyncIteration:
                    return
                streamed = streamed or isinstance(value, StreamEvent | StreamError)
                yield value
                continue
            item = asyncio.ensure_future(anext(items))
            waiting = asyncio.ensure_future(drained.wait())
            await asyncio.wait((item, waiting), return_when=asyncio.FIRST_COMPLETED)
            waiting.cancel()
            if not item.done():
                item.cancel()  # vLLM aborts the request
                await asyncio.gather(item, return_exceptions=True)
                break
            try:
                value = item.result()
            except StopAsyncIteration:
                return
            streamed = streamed or isinstance(value, StreamEvent | StreamError)
            yield value
        yield StreamError(error()) if streamed else error()
    finally:
        await items.aclose()


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


def prompt_token_ids(prompt: object) -> list[list[int]]:
    """The token-id prompts of a completion's `prompt` (vLLM's `CompletionRequest`:
    text, a list of texts, one list of token ids, or a list of them)."""
    if isinstance(prompt, list) and prompt and all(isinstance(item, int) for item in prompt):
        return [prompt]
    if isinstance(prompt, list):
        return [item for item in prompt if isinstance(item, list)]
    return []


def drain_error(rank: int, timeout_s: float) -> ErrorResponse:
    """The 503 body of a request still running when its rank's drain timeout passed."""
    message = (
        f"attention rank {rank} was removed by a resize and the request did not finish within "
        f"the drain timeout ({timeout_s:.0f} s, autoscale.drain_timeout_s); retry it"
    )
    return _unavailable(message)


def engine_failed(rank: int) -> ErrorResponse:
    """The 503 body of a request routed to a rank whose engine failed (its FFN peer was
    lost mid-step); Serve's health check replaces the rank."""
    message = f"attention rank {rank}'s engine failed (its FFN peer was lost) and is being replaced; retry it"
    return _unavailable(message)


def _unavailable(message: str) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type="ServiceUnavailableError", code=503))


def error_of(exc: Exception) -> ErrorResponse:
    """vLLM's mapping of an exception to an OpenAI error body (4xx for bad input)."""
    response = create_error_response(exc)
    if response.error.code >= 500:
        logger.exception("request failed", exc_info=exc)
    return response
