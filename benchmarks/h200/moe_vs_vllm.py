"""afd_ray's FFN MoE layer against plain vLLM's own MoE layer: same GPU, same T, same
rows, same weights (issue 32, capability 2). One GPU, after the device pack is installed:

    PYTHONPATH=.:/tmp/site python3 benchmarks/h200/moe_vs_vllm.py --out OUT/moe_vs_vllm.json

For each shape (`afd_ray.models.shapes`: DeepSeek-V2-Lite, Qwen3-30B-A3B, two decoder
layers, layer 1 an MoE layer, `load_format="dummy"`, bfloat16):
1. Plain vLLM runs in this process, eager (so that a forward hook sees its modules; the
   timing below replays CUDA graphs on both sides), and generates greedily for T streams.
   A forward hook on layer 1's MoE block (`model.model.layers[1].mlp`: gate, router,
   fused experts, shared experts) acts at the first decode step of T rows, for each T of
   `--tokens`; those are the rows the product benchmark's MoE layers see with dummy
   weights (where the routing gathers on few experts). Inside the hook (vLLM's forward
   context), with the same rows:
   - vLLM's block is captured in a CUDA graph and replayed: `vllm_ms` (median);
   - afd_ray's MoE (`FFNStack` layer 1, the FFN role's module, fused routing and fused
     experts on CUDA) gets the block's weights copied in; correctness first: its output
     against vLLM's (relative Frobenius error, `rel_err`, bound `REL_BOUND`) and the
     experts each chooses; then its CUDA graph is replayed: `afd_ms`.
   - the same on random rows of unit scale (`random_*`: every expert hit, the weight-read
     regime where the layer is bound by HBM).
2. `ffn_moe_over_vllm_moe` (shape -> T -> afd_ms / vllm_ms on the engine's rows) and the
   same on random rows go into the JSON; a table is printed last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from afd_ray.bench.moe_layer import graph_replay, median_ms

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: hooks see it
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model with a closure

SHAPES = ("deepseek-v2-lite", "qwen3-30b-a3b")
REL_BOUND = 2e-2
"""Bound on ||afd - vllm|| / ||vllm||: bfloat16 GEMMs, the fused kernel's bfloat16 sum of
a token's k rows, and the shared experts' sum."""
ITERS = 50
"""Timed CUDA graph replays per layer and rows (median)."""
PROMPT_TOKENS = 5
"""Tokens per prompt: a prefill of T x 5 rows never has T' rows for another measured T'."""


def _afd_block(vllm_block: torch.nn.Module, config) -> torch.nn.Module:
    """afd_ray's MoE of layer 1 with the weights of vLLM's block copied in."""
    from afd_ray.ffn.model import FFNStack
    from afd_ray.layers.moe import MoE

    with torch.device("meta"):
        stack = FFNStack(config, torch.bfloat16)
    stack.to_empty(device=torch.device("cuda"))
    block = stack.eval().layers[1]
    assert isinstance(block, MoE)
    with torch.no_grad():
        block.gate.weight.copy_(vllm_block.gate.weight)
        bias = getattr(vllm_block.gate, "e_score_correction_bias", None)
        if block.gate.e_score_correction_bias is not None and bias is not None:
            block.gate.e_score_correction_bias.copy_(bias)
        routed = vllm_block.experts.routed_experts  # FusedMoE(...) is a MoERunner; its RoutedExperts hold the weights
        block.experts.gate_up.copy_(routed.w13_weight)
        block.experts.down.copy_(routed.w2_weight)
        shared = getattr(vllm_block, "shared_experts", None)
        if block.shared_experts is not None and shared is not None:
            gate, up = shared.gate_up_proj.weight.chunk(2, dim=0)
            block.shared_experts.gate_proj.weight.copy_(gate)
            block.shared_experts.up_proj.weight.copy_(up)
            block.shared_experts.down_proj.weight.copy_(shared.down_proj.weight)
    return block


class _Probe:
    """The forward hook on vLLM's layer-1 MoE block: times both layers on its rows."""

    def __init__(self, config, tokens: list[int]) -> None:
        self.config = config
        self.pending = set(tokens)
        self.results: dict[str, dict] = {}
        self.afd: torch.nn.Module | None = None
        self.busy = False

    def __call__(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        rows = args[0]
        tokens = rows.shape[0]
        if self.busy or tokens not in self.pending:
            return
        self.pending.discard(tokens)
        self.busy = True
        try:
            self.results[str(tokens)] = self._measure(module, rows.detach().clone())
        except Exception as error:  # recorded, not raised: a failed T must not stop the others
            self.results[str(tokens)] = {"error": f"{type(error).__name__}: {error}"}
        finally:
            self.busy = False

    @torch.inference_mode()
    def _measure(self, module: torch.nn.Module, rows: torch.Tensor) -> dict:
        from vllm.forward_context import get_forward_context

        context = get_forward_context()
        index = getattr(context, "moe_layer_index", None)

        def vllm_call(x: torch.Tensor) -> Callable[[], torch.Tensor]:
            def call() -> torch.Tensor:
                if index is not None:  # the block looks its layer up by the next MoE index
                    context.moe_layer_index = index - 1
                return module(x)

            return call

        if self.afd is None:
            self.afd = _afd_block(module, self.config)
        afd = self.afd
        record = {}
        generator = torch.Generator("cuda").manual_seed(rows.shape[0])
        random_rows = torch.randn(rows.shape, generator=generator, device="cuda", dtype=torch.float32).to(rows.dtype)
        for name, x in (("", rows), ("random_", random_rows)):
            theirs = vllm_call(x)()
            ours = afd(x)
            rel_err = float((ours.float() - theirs.float()).norm() / theirs.float().norm().clamp_min(1e-30))
            routing = afd.route(x)
            vllm_replay, vllm_out = graph_replay(vllm_call(x))
            afd_replay, afd_out = graph_replay(lambda x=x: afd(x))
            vllm_replay()
            afd_replay()
            torch.cuda.synchronize()
            graph_rel_err = float(
                (afd_out.float() - vllm_out.float()).norm() / vllm_out.float().norm().clamp_min(1e-30)
            )
            vllm_ms = median_ms(vllm_replay, ITERS)
            afd_ms = median_ms(afd_replay, ITERS)
            record.update(
                {
                    f"{name}rel_err": rel_err,
                    f"{name}graph_rel_err": graph_rel_err,
                    f"{name}correct": rel_err <= REL_BOUND and graph_rel_err <= REL_BOUND,
                    f"{name}distinct_experts": int(routing.ids.unique().numel()),
                    f"{name}vllm_ms": vllm_ms,
                    f"{name}afd_ms": afd_ms,
                    f"{name}afd_over_vllm": afd_ms / vllm_ms,
                }
            )
        if index is not None:
            context.moe_layer_index = index
        return record


def _shape(shape: str, tokens: list[int], root: Path) -> dict:
    from vllm import LLM, SamplingParams

    from afd_ray.models.shapes import build_shape, shape_config

    config = shape_config(shape, num_hidden_layers=2)
    folder = build_shape(shape, root / shape, num_hidden_layers=2)
    start = time.perf_counter()
    llm = LLM(
        model=str(folder),
        dtype="bfloat16",
        load_format="dummy",
        enforce_eager=True,
        max_model_len=256,
        max_num_seqs=max(tokens),
        max_num_batched_tokens=max(tokens) * PROMPT_TOKENS,
        gpu_memory_utilization=0.4,
        seed=0,
    )
    started_s = time.perf_counter() - start
    probe = _Probe(config, tokens)
    llm.apply_model(lambda model: model.model.layers[1].mlp.register_forward_hook(probe) and None)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for count in tokens:
        prompts = [{"prompt_token_ids": [(7 * s + j) % 1000 + 2 for j in range(PROMPT_TOKENS)]} for s in range(count)]
        llm.generate(prompts, params, use_tqdm=False)
    result = {"engine_start_s": round(started_s, 1), "tokens": probe.results, "not_seen": sorted(probe.pending)}
    del llm
    gc.collect()
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    args = parser.parse_args()
    import vllm

    result: dict = {
        "gpu": torch.cuda.get_device_name(0),
        "vllm_version": vllm.__version__,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "commit": os.environ.get("COMMIT", "unknown"),
        "shapes": {},
    }
    for shape in args.shapes:
        result["shapes"][shape] = _shape(shape, args.tokens, Path("/tmp/afd-moe-vs-vllm"))
    result["ffn_moe_over_vllm_moe"] = {
        shape: {t: r["afd_over_vllm"] for t, r in data["tokens"].items() if "afd_over_vllm" in r}
        for shape, data in result["shapes"].items()
    }
    result["ffn_moe_over_vllm_moe_random_rows"] = {
        shape: {t: r["random_afd_over_vllm"] for t, r in data["tokens"].items() if "random_afd_over_vllm" in r}
        for shape, data in result["shapes"].items()
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{'shape':18} {'T':>4} {'rows':7} {'experts':>7} {'vLLM ms':>8} {'afd ms':>8} {'ratio':>6} {'rel err':>8}")
    for shape, data in result["shapes"].items():
        for tokens, record in data["tokens"].items():
            if "error" in record:
                print(f"{shape:18} {tokens:>4} ERROR {record['error']}")
                continue
            for name, label in (("", "engine"), ("random_", "random")):
                print(
                    f"{shape:18} {tokens:>4} {label:7} {record[name + 'distinct_experts']:>7} "
                    f"{record[name + 'vllm_ms']:>8.4f} {record[name + 'afd_ms']:>8.4f} "
                    f"{record[name + 'afd_over_vllm']:>6.3f} {record[name + 'rel_err']:>8.1e}"
                )
    if any(data["not_seen"] for data in result["shapes"].values()):
        print("not seen:", {shape: data["not_seen"] for shape, data in result["shapes"].items()})


if __name__ == "__main__":
    main()
