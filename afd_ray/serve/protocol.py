"""The request bodies the ingress accepts: vLLM's own request models, with the bounds
that vLLM checks only later, in the attention replica, without naming the field.

Checked here, a bad value is a pydantic error at the ingress, so it leaves as a 400
whose `param` names the field (`afd_ray.serve.errors`), like every other field
check; the bounds also appear in the OpenAPI schema. The class names are vLLM's, so
the schema keeps its names. Instances are vLLM request models (`isinstance` holds)
and travel to the attention replica as they are (chat messages once `materialized`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

import vllm.envs as envs
from fastapi.exceptions import RequestValidationError
from pydantic import Field, ValidationError
from vllm.entrypoints.openai.chat_completion import protocol as chat
from vllm.entrypoints.openai.completion import protocol as completion

__all__ = ["ChatCompletionRequest", "CompletionRequest", "materialized"]

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


def materialized(request: ChatCompletionRequest) -> ChatCompletionRequest:
    """`request` with every iterator inside its messages turned into a list. vLLM's
    chat message types declare content parts and tool calls as `Iterable`, which
    pydantic keeps as lazy validating iterators that cannot be pickled to the
    attention replica (a list of content parts was a 500; found by the fuzz test).

    Raises:
        RequestValidationError: an item of such an iterator does not validate (400
            naming the message; the key is in the error's own `loc`).
    """
    messages = []
    for index, message in enumerate(request.messages):
        try:
            messages.append(_materialized(message))  # a dict (TypedDict) or a pydantic message
        except ValidationError as exc:
            raise RequestValidationError(
                [error | {"loc": ("body", "messages", index, *error["loc"])} for error in exc.errors()]
            ) from None
    return request.model_copy(update={"messages": messages})


def _materialized(value: object) -> object:
    if isinstance(value, dict):
        return {key: _materialized(item) for key, item in value.items()}
    if isinstance(value, list | tuple | Iterator):
        return [_materialized(item) for item in value]
    return value
