"""`attention.engine_args`: vLLM engine arguments passed through to the attention engine.

The keys are checked against the installed vLLM's own `EngineArgs` dataclass (its
fields, read with `dataclasses.fields`, so another vLLM version brings its own list),
and each value against that field's annotation where pydantic can build a validator
for it. Keys that afd_ray sets itself (`OWNED`) are refused with the afd_ray key to use
instead. vLLM is imported only when a config has `engine_args`: a config without
them validates without it.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import sys
import typing
from typing import Annotated

from pydantic import AfterValidator, ConfigDict, JsonValue, TypeAdapter, ValidationError

__all__ = ["OWNED", "EngineArgName", "check_engine_arg_values", "owner_of", "vllm_engine_fields"]


@dataclasses.dataclass(frozen=True)
class Owner:
    """Why afd_ray sets an engine argument itself, and where the user sets it instead."""

    key: str | None
    """The afd_ray config key that decides it; None where afd_ray alone decides."""
    why: str


_LAYOUT = Owner("attention.num_ranks / ffn.num_ranks", "one vLLM engine per attention rank; AFD sets the layout")
_KV = Owner("attention.kv_cache_gib", "the KV-cache size per rank")
_CHECKPOINT = Owner("model.source", "both roles read the same checkpoint and its config.json")
_QUANT = Owner("model.quantization", "one setting for both roles' weights")
_AFD_MODEL = Owner(None, "carries the AFD model class (attention role only, MLPs on the FFN pool)")

OWNED: dict[str, Owner] = {
    "model": _CHECKPOINT,
    "model_weights": _CHECKPOINT,
    "hf_config_path": _CHECKPOINT,
    "served_model_name": Owner("model.served_name", "the id `/v1/models` lists"),
    "dtype": Owner("model.dtype", "both roles compute in it"),
    "max_model_len": Owner("model.max_model_len", "the context length of the app"),
    "load_format": Owner("model.load_format", "both roles load (or fill) their weights the same way"),
    "quantization": _QUANT,
    "quantization_config": _QUANT,
    "max_num_seqs": Owner("attention.max_num_seqs", "admission and the Serve replica's queue use it"),
    "stream_interval": Owner("attention.stream_interval", "tokens per streamed chunk"),
    "enforce_eager": Owner("attention.enforce_eager", "the FFN role captures graphs to match"),
    "compilation_config": Owner(
        "attention.enforce_eager / attention.cudagraph_mode", "graphs are split at the FFN boundary ops"
    ),
    "kv_cache_memory_bytes": _KV,
    "num_gpu_blocks_override": _KV,
    "gpu_memory_utilization": Owner("attention.gpu_memory_utilization", "the FFN role may share the GPU"),
    "hf_overrides": _AFD_MODEL,
    "model_class_overrides": _AFD_MODEL,
    "model_impl": _AFD_MODEL,
    "worker_extension_cls": Owner(None, "the AFD worker extension holds the FFN client"),
    "additional_config": Owner(None, "carries the FFN peer of the rank"),
    "disable_log_stats": Owner(None, "admission and autoscaling read the engine's stats"),
    "tensor_parallel_size": _LAYOUT,
    "pipeline_parallel_size": _LAYOUT,
    "data_parallel_size": _LAYOUT,
    "decode_context_parallel_size": _LAYOUT,
    "prefill_context_parallel_size": _LAYOUT,
    "enable_expert_parallel": Owner("ffn.num_ranks", "experts are split over the FFN ranks (EP)"),
    "distributed_executor_backend": _LAYOUT,
}
"""Engine arguments afd_ray sets (`afd_ray.attention.engine.engine_args`) or must keep
at vLLM's default, by name. Every `data_parallel_*` argument is owned as the layout."""

_OWNED_PREFIX = "data_parallel_"


def owner_of(name: str) -> Owner | None:
    """Who decides the engine argument `name` in afd_ray, or None if the user may."""
    return _LAYOUT if name.startswith(_OWNED_PREFIX) else OWNED.get(name)


@functools.cache
def vllm_engine_fields() -> dict[str, dataclasses.Field]:
    """The fields of the installed vLLM's `AsyncEngineArgs`, by name (imports vLLM)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return {field.name: field for field in dataclasses.fields(AsyncEngineArgs) if field.init}


def _check_name(name: str) -> str:
    owner = owner_of(name)
    if owner is not None:
        where = f"set {owner.key} instead" if owner.key else "afd_ray sets it"
        raise ValueError(f"{name!r} is owned by afd_ray ({owner.why}): {where}")
    fields = vllm_engine_fields()
    if name not in fields:
        import vllm

        near = difflib.get_close_matches(name, fields, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ValueError(f"{name!r} is not an engine argument of vLLM {vllm.__version__}{hint}")
    return name


EngineArgName = Annotated[str, AfterValidator(_check_name)]
"""A key of `attention.engine_args`: a field of vLLM's `EngineArgs` that afd_ray does not own."""


@functools.cache
def _value_adapter(name: str) -> TypeAdapter | None:
    """A strict validator of the field's annotation, or None where pydantic cannot
    check it as vLLM reads it: an annotation that does not resolve, has no pydantic
    schema (vLLM's own config classes) or holds an enum (vLLM takes its members'
    names as strings). vLLM checks those at engine start."""
    hint = vllm_engine_fields()[name].type
    try:
        if isinstance(hint, str):
            hint = eval(hint, vars(sys.modules["vllm.engine.arg_utils"]))
        if _holds_enum(hint):
            return None
        return TypeAdapter(hint, config=ConfigDict(strict=True))
    except Exception:  # NameError, PydanticSchemaGenerationError, PydanticUserError, ...
        return None


def _holds_enum(hint: object) -> bool:
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return True
    return any(_holds_enum(arg) for arg in typing.get_args(hint))


def check_engine_arg_values(args: dict[str, JsonValue], where: str) -> dict[str, JsonValue]:
    """`args` unchanged, once each value fits its `EngineArgs` field's annotation.

    Args:
        args: engine argument name -> value, names already checked (`EngineArgName`).
        where: the key path of `args` in the config tree, for messages.

    Raises:
        ValueError: every value of another type (strict: no `"7"` for an integer),
            joined by "; "; each starts with its key path
            (`attention.engine_args.seed: ...`) and gives vLLM's annotation.
    """
    problems = []
    for name, value in args.items():
        adapter = _value_adapter(name)
        if adapter is None:
            continue
        try:
            adapter.validate_python(value)
        except ValidationError:
            hint = vllm_engine_fields()[name].type
            shown = hint.__name__ if isinstance(hint, type) else str(hint)
            problems.append(f"{where}.{name}: {value!r} does not fit vLLM's type {shown}")
    if problems:
        raise ValueError("; ".join(problems))
    return args
