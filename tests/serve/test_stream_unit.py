"""The typed stream without Ray: an attention rank reads vLLM's SSE text once into
typed items (`afd_ray.attention.responses`), the ingress frames them again
(`afd_ray.serve.stream`, `afd_ray.serve.errors.sse_error`): the client gets vLLM's
bytes; a drained stream ends with a typed error; a request whose rank died before
answering gets 503."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator

from ray.exceptions import ActorDiedError
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
)
from vllm.entrypoints.openai.completion.protocol import (
    CompletionLogProbs,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)

from afd_ray.attention.chunks import StreamError, StreamEvent
from afd_ray.attention.responses import drain_error, relay, until_drained
from afd_ray.compat import ErrorInfo, ErrorResponse
from afd_ray.serve.errors import sse_error
from afd_ray.serve.gate import Pass, Ticket
from afd_ray.serve.stream import Source, respond

_CHOICE = {"index": 0, "text": "é x", "logprobs": None, "finish_reason": None, "stop_reason": None}
_COMPLETION = CompletionStreamResponse(
    id="cmpl-1",
    created=5,
    model="m",
    choices=[CompletionResponseStreamChoice(**_CHOICE, prompt_token_ids=[1, 2], token_ids=[3])],
)
_LOGPROBS = _COMPLETION.model_copy(
    update={
        "choices": [
            CompletionResponseStreamChoice(
                index=0,
                text="x",
                finish_reason="length",
                stop_reason=None,
                logprobs=CompletionLogProbs(
                    text_offset=[0], token_logprobs=[-0.5], tokens=["x"], top_logprobs=[{"x": -0.5, "y": -9999.0}]
                ),
            )
        ]
    }
)
_CHAT = ChatCompletionStreamResponse(
    id="c",
    created=3,
    model="m",
    choices=[
        ChatCompletionResponseStreamChoice.model_validate(
            {"index": 0, "delta": {"content": "日本"}, "finish_reason": "stop", "token_ids": [5]}
        )
    ],
)
_ERROR = ErrorResponse(error=ErrorInfo(message="boom", type="InternalServerError", code=500))


def _vllm_stream(events: list[str]) -> object:
    """What vLLM's `create_completion` returns for a stream: SSE text, ended by `[DONE]`."""

    async def answer() -> AsyncGenerator[str, None]:
        for event in [*events, "data: [DONE]\n\n"]:
            yield event

    async def call() -> object:
        return answer()

    return call()


def _framed(item: object) -> str:
    """The SSE event the ingress sends for `item`."""
    if isinstance(item, StreamError):
        return sse_error(item.error)
    assert isinstance(item, StreamEvent)
    return f"data: {item.payload.model_dump_json(exclude_unset=True)}\n\n"


async def _items(events: list[str], stream: type) -> list[object]:
    return [item async for item in relay(_vllm_stream(events), (), stream)]


def test_the_client_gets_vllms_bytes() -> None:
    completion = [
        f"data: {_COMPLETION.model_dump_json(exclude_unset=True)}\n\n",
        f"data: {_LOGPROBS.model_dump_json(exclude_unset=True)}\n\n",
        f"data: {_COMPLETION.model_copy(update={'choices': []}).model_dump_json(exclude_none=True)}\n\n",
        f"data: {json.dumps(_ERROR.model_dump())}\n\n",  # vLLM's error event during generation
    ]
    items = asyncio.run(_items(completion, CompletionStreamResponse))
    assert [type(item) for item in items] == [StreamEvent, StreamEvent, StreamEvent, StreamError]  # no [DONE]
    assert [_framed(item) for item in items] == completion
    assert items[0].payload.choices[0].token_ids == [3]
    chat = [f"data: {_CHAT.model_dump_json(exclude_unset=True)}\n\n"]
    items = asyncio.run(_items(chat, ChatCompletionStreamResponse))
    assert [_framed(item) for item in items] == chat


def test_a_drained_stream_ends_with_a_typed_error() -> None:
    async def run(stream: bool) -> list[object]:
        draining, drained = asyncio.Event(), asyncio.Event()
        draining.set()
        asyncio.get_running_loop().call_later(0.1, drained.set)  # the drain timeout passes

        async def items() -> AsyncGenerator[object, None]:
            yield StreamEvent(_COMPLETION) if stream else _ERROR
            await asyncio.sleep(60)  # no answer before the drain timeout: the request is aborted
            yield _ERROR

        return [item async for item in until_drained(items(), draining, drained, lambda: drain_error(3, 30.0))]

    streamed = asyncio.run(run(stream=True))
    assert isinstance(streamed[-1], StreamError) and streamed[-1].error.error.code == 503
    assert "attention rank 3" in streamed[-1].error.error.message
    whole = asyncio.run(run(stream=False))
    assert isinstance(whole[-1], ErrorResponse) and whole[-1].error.code == 503


def test_a_request_whose_rank_died_before_answering_gets_503_with_retry_after() -> None:
    """A non-streaming request whose attention rank died (Ray's `ActorDiedError` from the
    call) cannot move: 503 with `Retry-After`, and its place is given back. It was a 500
    before (found by tests/e2e/test_soak.py's attention SIGKILL)."""

    class DeadRank:  # the attention pool's handle, its replica killed mid-request
        def remote(self, request: object) -> AsyncGenerator[object, None]:
            async def answer() -> AsyncGenerator[object, None]:
                raise ActorDiedError()
                yield

            return answer()

    released: list[bool] = []
    source = Source(DeadRank(), object(), None, lambda: None)
    response = asyncio.run(respond(source, Pass(Ticket(released.append), None, None), 2))
    assert response.status_code == 503 and response.headers["retry-after"] == "2", response.body
    assert "ActorDiedError" in json.loads(response.body)["error"]["message"] and released == [False]
