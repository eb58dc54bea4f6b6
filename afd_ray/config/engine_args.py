"""`attention.engine_args`: vLLM engine arguments passed through to the attention engine.

The keys are checked against the installed vLLM's own `EngineArgs` dataclass (its
fields, read with `dataclasses.fields`, so another vLLM version brings its own list),
and each value against that field's annotation where pydantic can build a validator
for it, and against the bounds of the vLLM config field it fills (`_config_bounds`).
Keys that afd_ray sets itself (`OWNED`) are refused with the afd_ray key to use
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

from pydantic import AfterValidator, ConfigDict, JsonValue, TypeAdapter, ValidationError, ValidatorFunctionWrapHandler
from pydantic_core import ErrorDetails, InitErrorDetails, PydanticCustomError

__all__ = [
    "OWNED",
    "EngineArgName",
    "engine_arg_value_errors",
    "owner_of",
    "validate_engine_args",
    "vllm_engine_fields",
]


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


@functools.cache
def _config_bounds() -> dict[str, tuple[str, TypeAdapter]]:
    """Engine argument name -> (`Class.field`, validator) for the arguments that fill a
    field with bounds (`Field(gt=0)`, ...) of one of vLLM's config classes
    (`vllm.config`: `CacheConfig.block_size`, `SchedulerConfig.max_num_batched_tokens`,
    ...), which vLLM checks only when it builds the engine's config at engine start.
    A name that several classes hold is left out, as is a field whose annotation
    pydantic cannot build."""
    import vllm.config

    found: dict[str, list[tuple[str, TypeAdapter]]] = {}
    names = vllm_engine_fields()
    for class_name in vllm.config.__all__:
        fields = getattr(getattr(vllm.config, class_name), "__pydantic_fields__", None)
        if not isinstance(fields, dict):
            continue
        for name, info in fields.items():
            if name not in names or not info.metadata:
                continue
            try:
                adapter = TypeAdapter(Annotated[info.annotation, *info.metadata])
            except Exception:  # an annotation pydantic cannot build alone
                continue
            found.setdefault(name, []).append((f"{class_name}.{name}", adapter))
    return {name: held[0] for name, held in found.items() if len(held) == 1}


def engine_arg_value_errors(args: dict[str, object], where: str) -> dict[str, str]:
    """The values of `args` that do not fit their `EngineArgs` field's annotation
    (strict: no `"7"` for an integer) or the bounds of the vLLM config field they
    fill (`_config_bounds`: no `block_size: -5`), by name; keys that are not engine
    arguments afd_ray passes (`owner_of`, unknown names) are skipped: their key is the
    error. A null value is left to vLLM (its default).

    Each message starts with its key path (`attention.engine_args.seed: ...`, `where`
    the key path of `args`) and gives vLLM's annotation or bound.
    """
    problems = {}
    fields = vllm_engine_fields()
    for name, value in args.items():
        if name not in fields or owner_of(name) is not None:
            continue
        adapter = _value_adapter(name)
        try:
            if adapter is not None:
                adapter.validate_python(value)
        except ValidationError:
            hint = fields[name].type
            shown = hint.__name__ if isinstance(hint, type) else str(hint)
            problems[name] = f"{where}.{name}: {value!r} does not fit vLLM's type {shown}"
            continue
        bounded = _config_bounds().get(name)
        if bounded is None or value is None:
            continue
        try:
            bounded[1].validate_python(value)
        except ValidationError as e:
            reason = "; ".join(error["msg"] for error in e.errors())
            problems[name] = f"{where}.{name}: {value!r} does not fit vLLM's {bounded[0]}: {reason}"
    return problems


def validate_engine_args(args: object, handler: ValidatorFunctionWrapHandler, where: str) -> dict[str, JsonValue]:
    """A wrap validator of `engine_args` (`dict[EngineArgName, JsonValue]`): `handler`
    checks the keys (`EngineArgName`) and that the values are JSON, then every value
    of a passed engine argument is checked (`engine_arg_value_errors`), even when a
    key beside it is refused, so that all the errors come at once.

    Raises:
        pydantic.ValidationError: one error per bad key (at `(name, "[key]")`) and per
            bad value (at `(name,)`).
    """
    try:
        checked, errors = handler(args), []
    except ValidationError as e:
        if not isinstance(args, dict):
            raise
        checked, errors = None, [_details(error) for error in e.errors()]
    if isinstance(args, dict):
        for name, message in engine_arg_value_errors(args, where).items():
            kind = PydanticCustomError("value_error", "{message}", {"message": message})
            errors.append(InitErrorDetails(type=kind, loc=(name,), input=args[name]))
    if errors:
        raise ValidationError.from_exception_data("engine_args", errors)
    return checked


def _details(error: ErrorDetails) -> InitErrorDetails:
    """A pydantic error as it is raised again."""
    details = InitErrorDetails(type=error["type"], loc=error["loc"], input=error["input"])
    if "ctx" in error:
        details["ctx"] = error["ctx"]
    return details
