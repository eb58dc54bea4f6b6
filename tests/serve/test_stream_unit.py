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
    CompletionRequest,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
)

from afd_ray.attention.chunks import StreamError, StreamEvent
from afd_ray.attention.responses import drain_error, relay, until_drained
from afd_ray.compat import ErrorInfo, ErrorResponse
from afd_ray.serve.errors import sse_error
from afd_ray.serve.gate import Pass, Ticket
from afd_ray.serve.resume import StreamResume
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


def _dies_after(chunks: list[CompletionStreamResponse]) -> tuple[object, list[object]]:
    """An attention pool handle whose rank yields `chunks`, then dies (Ray's
    `ActorDiedError`); the list records every request sent to it."""
    sent: list[object] = []

    class Rank:
        def remote(self, request: object) -> AsyncGenerator[object, None]:
            sent.append(request)

            async def answer() -> AsyncGenerator[object, None]:
                for chunk in chunks:
                    yield StreamEvent(chunk)
                raise ActorDiedError()

            return answer()

    return Rank(), sent


def test_a_stream_whose_rank_dies_after_the_whole_answer_ends_with_done() -> None:
    """The rank dies after the answer's last token but before its stream ended: the
    client has every token, so the stream ends with `[DONE]`, not a 503 error event,
    and nothing is re-sent. It was cut with "... failed; retry it" (found by
    tests/e2e/test_soak.py, a request lost with all its tokens streamed)."""

    def chunk(tokens: list[int], finish: str | None) -> CompletionStreamResponse:
        choice = {"index": 0, "text": "x", "finish_reason": finish, "token_ids": tokens, "prompt_token_ids": [1]}
        return CompletionStreamResponse.model_validate({"id": "a", "created": 1, "model": "m", "choices": [choice]})

    async def body(response: object) -> str:
        return "".join([part if isinstance(part, str) else part.decode() async for part in response.body_iterator])

    cases = {
        "finish_reason": ([chunk([5], None), chunk([6], "stop")], 8),  # stopped early, then died
        "max_tokens": ([chunk([5], None), chunk([6], None)], 2),  # every token came, no finish seen
    }
    for name, (chunks, max_tokens) in cases.items():
        request = CompletionRequest(model="m", prompt="hi", stream=True, max_tokens=max_tokens)
        rank, sent = _dies_after(chunks)
        source = Source(rank, request, StreamResume(request), lambda: None)
        text = asyncio.run(_stream_text(source, body))
        assert text.endswith("data: [DONE]\n\n") and "error" not in text, (name, text)
        assert text.count("data: {") == 2 and len(sent) == 1, (name, text, sent)
    # not whole: the rank died mid-answer, so the stream moves to another rank
    request = CompletionRequest(model="m", prompt="hi", stream=True, max_tokens=8)
    rank, sent = _dies_after([chunk([5], None)])
    resume = StreamResume(request)
    source = Source(rank, request, resume, lambda: None)
    asyncio.run(_stream_text(source, body))
    assert len(sent) > 1 and sent[1].prompt == [1, 5] and sent[1].max_tokens == 7


async def _stream_text(source: Source, body: object) -> str:
    response = await respond(source, Pass(Ticket(lambda expired: None), None, None), 2)
    return await body(response)
