"""The FFN role's blocks against plain vLLM's own modules, bit for bit, on one GPU.

Plain vLLM (in-process) generates from the tiny DeepSeek-V3 (bf16, MLA heads) with
forward hooks on every decoder layer's `mlp` (eager engine only: a compiled engine
traces them) and on the MoE layers' `shared_experts` (they run inside vLLM's opaque
fused-MoE op, so their hooks fire in a compiled engine too, with CUDA graphs off).
The FFN stack (`afd_ray.ffn`) then computes the same blocks from the captured
inputs. Prints one JSON line per comparison: rows compared, rows bit-equal, max abs
difference. Also compares DeepSeek's routing (ids, weights) with vLLM's
`grouped_topk` on the same logits.

    PYTHONPATH=.:/tmp/site python3 benchmarks/h200/ffn_vs_vllm.py
"""

from __future__ import annotations

import gc
import json
import os
import tempfile
from pathlib import Path

import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

PROMPTS = [
    "The quick brown fox",
    "def main():",
    "Hello, my name is",
    "import os",
    "class Node:",
    "In the beginning",
    "x " * 40,
]  # the last one is longer than every captured graph size
CAPTURED: dict[tuple[str, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}


def _install(model: torch.nn.Module, mlp_hooks: bool) -> int:
    for i, layer in enumerate(model.model.layers):

        def keep(kind: str, i: int):
            def hook(module, args, out):
                out = out[0] if isinstance(out, tuple) else out
                CAPTURED.setdefault((kind, i), []).append((args[0].detach().clone(), out.detach().clone()))

            return hook

        if mlp_hooks:
            layer.mlp.register_forward_hook(keep("mlp", i))
        shared = getattr(layer.mlp, "shared_experts", None)
        if shared is not None:
            shared.register_forward_hook(keep("shared", i))
    return len(model.model.layers)


def _plain(checkpoint: Path, eager: bool) -> None:
    from vllm import LLM, SamplingParams

    graphs = {} if eager else {"compilation_config": {"cudagraph_mode": "NONE"}}
    llm = LLM(
        str(checkpoint),
        dtype="bfloat16",
        enforce_eager=eager,
        max_model_len=512,
        max_num_seqs=8,
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=1 << 28,
        **graphs,
    )
    llm.apply_model(lambda model: _install(model, mlp_hooks=eager))
    CAPTURED.clear()  # drop what warm-up and profiling ran
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def _report(name: str, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    rows = equal = 0
    diff = 0.0
    for ours, theirs in pairs:
        rows += ours.shape[0]
        equal += int((ours == theirs).all(dim=-1).sum())
        diff = max(diff, float((ours.float() - theirs.float()).abs().max()))
    print(
        "FFN_VS_VLLM " + json.dumps({"what": name, "rows": rows, "rows_equal": equal, "max_abs_diff": diff}), flush=True
    )


def main() -> None:
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import grouped_topk

    from afd_ray.ffn.model import load_ffn_stack
    from afd_ray.layers.moe import MoE
    from afd_ray.models.tiny import build_tiny

    checkpoint = build_tiny("deepseek_v3", Path(tempfile.mkdtemp()) / "deepseek_v3", cuda_mla_heads=True)
    device = torch.device("cuda")
    for eager in (True, False):
        _plain(checkpoint, eager)
        mode = "eager" if eager else "compiled"
        split = load_ffn_stack(checkpoint, torch.bfloat16, device, attention_compiled=True)
        summed = load_ffn_stack(checkpoint, torch.bfloat16, device, attention_compiled=not eager)
        for block in split.layers:  # the activation rounding of this mode, the output split
            for mlp in (block, getattr(block, "shared_experts", None)):
                if mlp is not None and hasattr(mlp, "act_in_float32"):
                    mlp.act_in_float32 = not eager
        with torch.inference_mode():
            for (kind, i), items in sorted(CAPTURED.items()):
                block = summed.layers[i]
                if kind == "shared":
                    _report(f"{mode} layer {i} shared experts", [(block.shared(x), y) for x, y in items])
                    continue
                if not isinstance(block, MoE):
                    _report(f"{mode} layer {i} dense MLP", [(block(x), y) for x, y in items])
                    continue
                _report(f"{mode} layer {i} MoE, our sum (fp32, weights scaled)", [(block(x), y) for x, y in items])
                pairs = []
                for x, y in items:
                    parts = split(i, x)  # [T, 2, H]
                    scale = block.spec.scaling_factor
                    pairs.append((parts[:, 1] + parts[:, 0] * scale, y))  # vLLM's eager tail, bf16 ops
                _report(f"{mode} layer {i} MoE, parts combined as vLLM eager", pairs)
                ours_w, theirs_w, ids_equal = [], [], 0
                rows = 0
                for x, _ in items:
                    router = split.layers[i].gate
                    logits = torch.nn.functional.linear(x, router.weight)  # [T, E] bf16
                    mine = router(x)
                    weights, ids = grouped_topk(
                        x,
                        logits,
                        router.spec.top_k,
                        router.spec.renormalize,
                        router.spec.num_groups,
                        router.spec.top_groups,
                        "sigmoid",
                        1.0,
                        router.e_score_correction_bias,
                    )
                    a, ia = mine.ids.sort(dim=-1)
                    b, ib = ids.long().sort(dim=-1)
                    rows += x.shape[0]
                    same = (a == b).all(dim=-1)
                    ids_equal += int(same.sum())
                    ours_w.append(mine.weights.gather(1, ia)[same])
                    theirs_w.append(weights.gather(1, ib)[same])
                print(
                    "FFN_VS_VLLM "
                    + json.dumps({"what": f"{mode} layer {i} routing", "rows": rows, "ids_equal": ids_equal}),
                    flush=True,
                )
                _report(
                    f"{mode} layer {i} routing weights (rows with equal ids)", list(zip(ours_w, theirs_w, strict=True))
                )
        CAPTURED.clear()
        del split, summed
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
