"""The request bodies the ingress accepts: vLLM's own request models, with the bounds
that vLLM checks only later, in the attention replica, without naming the field; and
the items an attention replica streams back to the ingress.

Checked here, a bad value is a pydantic error at the ingress, so it leaves as a 400
whose `param` names the field (`afd_ray.serve.ingress`), like every other field
check; the bounds also appear in the OpenAPI schema. The class names are vLLM's, so
the schema keeps its names. Instances are vLLM request models (`isinstance` holds)
and travel to the attention replica as they are.
"""

from __future__ import annotations

from typing import Annotated

import vllm.envs as envs
from pydantic import Field
from vllm.entrypoints.openai.chat_completion import protocol as chat
from vllm.entrypoints.openai.completion import protocol as completion

from afd_ray.compat import ErrorResponse

__all__ = ["ChatChunk", "ChatCompletionRequest", "CompletionChunk", "CompletionRequest"]

_MESSAGES = chat.ChatCompletionRequest.model_fields["messages"].annotation
"""vLLM's type of `messages`: a list of OpenAI (or vLLM custom) message dicts."""


class ChatCompletionRequest(chat.ChatCompletionRequest):
    """vLLM's chat request; `messages` must hold at least one message (an empty list
    failed in the chat template, a 400 without `param`) and `n` must be 1 to
    `VLLM_MAX_N_SEQUENCES` (vLLM's `SamplingParams` check names no field)."""

    messages: Annotated[_MESSAGES, Field(min_length=1)]  # type: ignore[valid-type]
    n: int | None = Field(1, ge=1, le=envs.VLLM_MAX_N_SEQUENCES)


class CompletionRequest(completion.CompletionRequest):
    """vLLM's completion request; `n` must be 1 to `VLLM_MAX_N_SEQUENCES` (vLLM's
    `SamplingParams` check names no field)."""

    n: int = Field(1, ge=1, le=envs.VLLM_MAX_N_SEQUENCES)


ChatChunk = str | chat.ChatCompletionResponse | ErrorResponse
"""An item of `AttentionServer.chat`: an SSE event, or the whole answer."""

CompletionChunk = str | completion.CompletionResponse | ErrorResponse
"""An item of `AttentionServer.completions`: an SSE event, or the whole answer."""
