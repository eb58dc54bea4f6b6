"""Resuming a streamed completion on another attention rank when its rank dies
(docs/failures.md): the ingress re-sends the prompt plus the tokens already streamed as a
token-id prompt, re-prefilled by a live rank, and continues the same SSE stream.

What is guaranteed:
- no token is sent twice and none is lost: the new request starts after the last
  token the client got, and asks for the remaining `max_tokens` (and `min_tokens`);
- greedy requests (`temperature: 0`) continue exactly as the unfailed run would
  (the same tokens: the continuation of a prefix is the suffix);
- sampled requests with a `seed` continue with the same seed, restarted at the resume
  point: deterministic for a given failure point, but not the tokens the unfailed run
  would have sampled; without a seed, a valid continuation;
- the stream keeps its `id` and `created`; `usage`, when asked for, counts the
  original prompt and all generated tokens.

Resumable: `/v1/completions` with `stream: true`, `n: 1`, one prompt (a string or
token ids), no `echo`, no `stop` strings (vLLM holds back text that may start one, so
the text sent lags the tokens), no `logprobs` (their text offsets restart). Other
requests, chat completions included, end with an explicit SSE error event.
"""

from __future__ import annotations

from vllm.entrypoints.openai.completion.protocol import CompletionRequest, CompletionStreamResponse

from afd_ray.attention.chunks import StreamEvent

__all__ = ["StreamResume"]


class StreamResume:
    """Follows one streamed completion (its events pass through `observe`) and
    builds the request that continues it.

    Args:
        request: the client's request; `request_for_rank` is what goes to the rank
            (it asks for token ids, which `observe` hides again unless the client
            asked for them).
    """

    def __init__(self, request: CompletionRequest) -> None:
        self._request = request
        self._show_ids = bool(request.return_token_ids)
        self._prompt: list[int] | None = None
        self._tokens: list[int] = []
        self._id: tuple[str, int] | None = None
        self.resumes = 0
        """How often the stream moved to another rank."""
        self.finished = False
        """Whether a chunk carried a `finish_reason`: the answer is whole, whatever
        happens to its rank before the stream's end."""

    @staticmethod
    def possible(request: CompletionRequest) -> bool:
        """Whether `request` can be resumed (see the module docstring)."""
        single = isinstance(request.prompt, str) or (
            isinstance(request.prompt, list) and all(isinstance(t, int) for t in request.prompt)
        )
        return bool(
            request.stream
            and request.n == 1
            and single
            and not request.echo
            and not request.stop
            and request.logprobs is None
        )

    @property
    def request_for_rank(self) -> CompletionRequest:
        return self._request.model_copy(update={"return_token_ids": True})

    def observe(self, event: StreamEvent) -> StreamEvent:
        """Record the token ids of one event of the rank and return the event the
        client gets (its original stream id; token ids only if it asked for them)."""
        chunk: CompletionStreamResponse = event.payload
        if self._id is None:
            self._id = (chunk.id, chunk.created)
        choices = []
        for choice in chunk.choices:
            if self._prompt is None and choice.prompt_token_ids is not None:
                self._prompt = list(choice.prompt_token_ids)
            self._tokens += choice.token_ids or []
            self.finished |= choice.finish_reason is not None
            if not self._show_ids:
                choice = choice.model_copy(update={"prompt_token_ids": None, "token_ids": None})
            elif self.resumes:  # the client got the original prompt's ids already
                choice = choice.model_copy(update={"prompt_token_ids": None})
            choices.append(choice)
        update: dict[str, object] = {"id": self._id[0], "created": self._id[1], "choices": choices}
        if chunk.usage and self.resumes and self._prompt is not None:
            update["usage"] = chunk.usage.model_copy(
                update={
                    "prompt_tokens": len(self._prompt),
                    "completion_tokens": len(self._tokens),
                    "total_tokens": len(self._prompt) + len(self._tokens),
                }
            )
        return StreamEvent(chunk.model_copy(update=update))

    @property
    def complete(self) -> bool:
        """Whether the client has the whole answer: a `finish_reason` came, or every
        `max_tokens` token did."""
        return self.finished or (self._request.max_tokens is not None and len(self._tokens) >= self._request.max_tokens)

    def next_request(self) -> CompletionRequest | None:
        """The request that continues the stream on another rank (None: the answer
        is `complete`)."""
        if self.complete:
            return None
        if self._prompt is None:  # nothing generated yet: the request as it was
            return self.request_for_rank
        remaining = None if self._request.max_tokens is None else self._request.max_tokens - len(self._tokens)
        self.resumes += 1
        return self._request.model_copy(
            update={
                "prompt": self._prompt + self._tokens,
                "max_tokens": remaining,
                "return_token_ids": True,
                "min_tokens": max(self._request.min_tokens - len(self._tokens), 0),
            }
        )
