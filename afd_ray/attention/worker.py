"""vLLM worker extension: AFD inspection inside the worker process that runs the model."""

from __future__ import annotations

from collections import defaultdict

__all__ = ["AFDWorkerExtension"]


class AFDWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); called via `collective_rpc`."""

    def afd_param_bytes(self) -> dict[str, int]:
        """Resident parameter bytes of the attention-role model, by leaf module kind.

        Keys are the parameter name with layer indices removed (e.g.
        `model.layers.self_attn.qkv_proj.weight`); values are bytes.
        """
        totals: dict[str, int] = defaultdict(int)
        for name, param in self.model_runner.model.named_parameters():
            key = ".".join(p for p in name.split(".") if not p.isdigit())
            totals[key] += param.numel() * param.element_size()
        return dict(totals)
