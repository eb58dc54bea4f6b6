"""The items an attention rank yields for one request (`AttentionServer.chat`,
`AttentionServer.completions`), typed: never SSE text. The ingress frames them as
SSE once (`afd_ray.serve.stream`).

An answer is either
- exactly one item, a whole response model or an `ErrorResponse` (a non-streaming
  request, or a request of either kind rejected before generation), or
- `StreamEvent` items, possibly ended by one `StreamError` (an accepted
  `stream: true` request); the end of the stream is the end of the generator
  (the ingress then sends `[DONE]`).
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionResponse, ChatCompletionStreamResponse
from vllm.entrypoints.openai.completion.protocol import CompletionResponse, CompletionStreamResponse

from afd_ray.compat import ErrorResponse

__all__ = ["ChatChunk", "CompletionChunk", "StreamError", "StreamEvent"]


@dataclass(frozen=True)
class StreamEvent:
    """One event of a streamed answer: vLLM's chunk as it built it. Its token ids are
    `payload.choices[i].token_ids` (set when the request has `return_token_ids`), the
    prompt's `payload.choices[i].prompt_token_ids` (completions, first event)."""

    payload: ChatCompletionStreamResponse | CompletionStreamResponse


@dataclass(frozen=True)
class StreamError:
    """The error that ends a stream whose events began (vLLM's error event during
    generation, or the rank's drain timeout): the client gets it as the last SSE
    event, then `[DONE]`. Never moves a stream to another rank."""

    error: ErrorResponse


ChatChunk = StreamEvent | StreamError | ChatCompletionResponse | ErrorResponse
"""An item of `AttentionServer.chat`."""

CompletionChunk = StreamEvent | StreamError | CompletionResponse | ErrorResponse
"""An item of `AttentionServer.completions`."""
