"""`StreamResume` without Ray: which requests are resumable, what the client sees, and
the request that continues a stream after the tokens already sent."""

from __future__ import annotations

import json

from vllm.entrypoints.openai.completion.protocol import CompletionRequest, CompletionStreamResponse

from afd_ray.attention.chunks import StreamEvent
from afd_ray.serve.resume import StreamResume


def _event(
    tokens: list[int], prompt: list[int] | None = None, usage: dict | None = None, rid: str = "a"
) -> StreamEvent:
    """An event as an attention rank yields it: vLLM's chunk, read from vLLM's JSON."""
    choice = {"index": 0, "text": "x" * len(tokens), "token_ids": tokens, "prompt_token_ids": prompt}
    body = {"id": rid, "created": 1, "model": "m", "choices": [choice], "usage": usage}
    return StreamEvent(CompletionStreamResponse.model_validate(body))


def _sent(event: StreamEvent) -> dict:
    """The JSON the client gets for `event` (as the ingress frames it)."""
    return json.loads(event.payload.model_dump_json(exclude_unset=True))


def test_resumable_requests() -> None:
    base = {"model": "m", "prompt": "hi", "stream": True}
    assert StreamResume.possible(CompletionRequest(**base))
    assert StreamResume.possible(CompletionRequest(**base | {"prompt": [1, 2, 3], "seed": 7, "temperature": 1}))
    for bad in ({"stream": False}, {"n": 2}, {"echo": True}, {"stop": ["."]}, {"logprobs": 1}, {"prompt": ["a", "b"]}):
        assert not StreamResume.possible(CompletionRequest(**base | bad)), bad


def test_resume_continues_after_the_last_token() -> None:
    request = CompletionRequest(
        model="m", prompt="hi", stream=True, max_tokens=5, min_tokens=3, stream_options={"include_usage": True}
    )
    resume = StreamResume(request)
    assert resume.request_for_rank.return_token_ids and not request.return_token_ids
    assert resume.next_request() == resume.request_for_rank  # nothing generated yet: resend as it was
    first = _sent(resume.observe(_event([10], prompt=[1, 2])))
    assert first["choices"][0]["token_ids"] is None and first["choices"][0]["prompt_token_ids"] is None
    resume.observe(_event([11]))
    again = resume.next_request()
    assert (again.prompt, again.max_tokens, again.min_tokens) == ([1, 2, 10, 11], 3, 1)
    assert resume.resumes == 1
    usage = {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7}
    out = _sent(resume.observe(_event([12, 13, 14], prompt=[1, 2, 10, 11], rid="b", usage=usage)))
    assert out["id"] == "a"  # the stream keeps its id
    assert out["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}
    assert resume.next_request() is None  # every token was generated


def test_token_ids_stay_when_the_client_asked() -> None:
    resume = StreamResume(CompletionRequest(model="m", prompt="hi", stream=True, return_token_ids=True))
    shown = _sent(resume.observe(_event([10], prompt=[1, 2])))
    assert shown["choices"][0]["token_ids"] == [10] and shown["choices"][0]["prompt_token_ids"] == [1, 2]
