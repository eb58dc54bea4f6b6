"""Plain vLLM's decode step with CUDA graphs against the FFN role's stack, kernel by
kernel (issue 13: the FFN part of an AFD step took longer than plain vLLM's whole step).
One H200, after the device pack is installed:

    PYTHONPATH=.:/tmp/site python3 benchmarks/h200/plain_step.py --out OUT/plain_step.json

1. Plain vLLM (in process, its default graphs FULL_AND_PIECEWISE, `load_format="dummy"`,
   bf16) on the DeepSeek-V2-Lite shape with the bench's prompts (4096 token ids per
   stream), warmed up (prefix cache), then 16 streams x `--new-tokens` greedy: the
   decode time per step, and the distinct tokens per step (the rows' routing spread).
2. The same generation for 16 tokens under torch.profiler: CUDA kernel time per decode
   step, by kernel name (fused MoE kernels, attention, GEMMs ...).
3. The FFN role's stack (`load_ffn_stack(random_weights=True)`, vLLM's dummy values)
   on random rows of the engine's row scale, T = 16 and 64: its top-k against vLLM's
   `grouped_topk` on the same logits first, then its per-bucket CUDA graphs
   (`FFNGraphs`) timed with CUDA events and under torch.profiler: kernel time per pass.
   `--ffn-only` runs this part alone.
Prints the kernel tables last; writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from afd_ray.bench.config import BenchConfig
from afd_ray.bench.runner import _prompts
from afd_ray.ffn.graphs import FFNGraphs
from afd_ray.ffn.model import load_ffn_stack
from afd_ray.models.shapes import build_shape

SHAPE = "deepseek-v2-lite"
STREAMS = 16
ROW_RMS = 2.9e-4
"""RMS of the MoE blocks' input rows of plain vLLM with dummy weights (ffn_routing.py)."""


def _kernels(prof: profile, per: int, top: int = 14) -> list[dict]:
    """The `top` CUDA kernels by total device time, µs per `per` (steps or passes)."""
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if device_us <= 0 or event.key.startswith("ProfilerStep"):
            continue
        rows.append({"kernel": event.key[:90], "us_per": round(device_us / per, 1), "calls_per": event.count / per})
    rows.sort(key=lambda r: -r["us_per"])
    total = round(sum(r["us_per"] for r in rows), 1)
    return [{"kernel": "TOTAL (all kernels)", "us_per": total, "calls_per": 0.0}, *rows[:top]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--ffn-only", action="store_true", help="skip plain vLLM (parts 1-2)")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: the profiler sees it
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    folder = build_shape(SHAPE, Path("/tmp/afd-routing") / SHAPE)
    cfg = BenchConfig(platform="cuda", prompt_tokens=4096, max_model_len=4352, seed=0)
    result: dict = {"gpu": torch.cuda.get_device_name(0), "shape": SHAPE, "streams": STREAMS}
    if not args.ffn_only:
        llm = LLM(
            model=str(folder),
            dtype="bfloat16",
            load_format="dummy",
            max_model_len=4352,
            gpu_memory_utilization=0.45,
            max_num_seqs=64,
            seed=0,
        )
        result["vllm_start_s"] = round(time.perf_counter() - t0, 1)
        prompts = [{"prompt_token_ids": ids} for ids in _prompts(cfg, folder, STREAMS)]
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)  # prefix cache
        first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        llm.generate(prompts, first, use_tqdm=False)  # its first call JIT-compiles a fused-MoE kernel
        start = time.perf_counter()
        llm.generate(prompts, first, use_tqdm=False)
        prefill_s = time.perf_counter() - start
        params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall_s = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        result["plain"] = {
            "wall_s": round(wall_s, 3),
            "first_token_s": round(prefill_s, 3),
            "decode_ms_per_step": round((wall_s - prefill_s) / (args.new_tokens - 1) * 1e3, 3),
            "distinct_tokens_per_step": [len({t[s] for t in tokens}) for s in range(args.new_tokens)],
        }
        profiled = SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, profiled, use_tqdm=False)
        result["plain"]["kernels_per_step"] = _kernels(prof, 17)
        del llm, outputs
        gc.collect()
        from vllm.distributed import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
        torch.cuda.empty_cache()

    device = torch.device("cuda", 0)
    stack = load_ffn_stack(folder, torch.bfloat16, device, random_weights=True)
    result["ffn"] = {}
    for tokens in (STREAMS, 4 * STREAMS):
        result["ffn"][str(tokens)] = _ffn_part(stack, tokens)
    result["elapsed_s"] = round(time.perf_counter() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    if "plain" in result:
        plain = result["plain"]
        print(
            f"plain: decode {plain['decode_ms_per_step']} ms/step, distinct tokens/step "
            f"{sorted(set(plain['distinct_tokens_per_step']))}"
        )
        tables = [("plain, per decode step", plain["kernels_per_step"])]
    else:
        tables = []
    for tokens, ffn in result["ffn"].items():
        print(
            f"FFN stack T={tokens}: {ffn['ms_per_pass']} ms/pass, distinct experts per layer "
            f"{ffn['distinct_experts']}, top-k equal to vLLM's grouped_topk: {ffn['topk_equal_vllm']}"
        )
        tables.append((f"FFN stack T={tokens}, per pass", ffn["kernels_per_pass"]))
    for name, table in tables:
        print(f"--- {name}: us, calls")
        for row in table[:8]:
            print(f"{row['us_per']:>9} {row['calls_per']:>6.1f}  {row['kernel']}")


@torch.inference_mode()
def _ffn_part(stack, tokens: int) -> dict:
    """The FFN stack at `tokens` rows of the engine's row scale: its routing against
    vLLM's `grouped_topk` (correctness first), then CUDA-event and profiler timing of
    its per-bucket graphs."""
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import grouped_topk

    device = next(stack.parameters()).device
    rows = [torch.randn(tokens, stack.hidden_size, device=device, dtype=torch.bfloat16) * ROW_RMS for _ in range(8)]
    block = stack.layers[1]
    spec = block.gate.spec
    logits = torch.nn.functional.linear(rows[0], block.gate.weight)
    route = getattr(grouped_topk, "_torchdynamo_orig_callable", grouped_topk)
    _, vllm_ids = route(
        rows[0],
        logits,
        spec.top_k,
        spec.renormalize,
        spec.num_groups,
        spec.top_groups,
        spec.scoring,
        spec.scaling_factor,
        None,
    )
    ours = block.gate(rows[0]).ids
    equal = bool(torch.equal(ours.sort(-1).values, vllm_ids.long().sort(-1).values))
    distinct = int(ours.unique().numel())
    compute = FFNGraphs(stack, None, torch.bfloat16, buckets=(tokens,))
    inputs = compute.inputs(tokens)

    def one_pass(i: int) -> None:
        for layer in range(stack.num_layers):
            inputs.hidden[:tokens].copy_(rows[(i + layer) % len(rows)])
            compute.run(layer, inputs)

    for i in range(3):
        one_pass(i)
    torch.cuda.synchronize()
    passes = 10
    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start_event.record()
    for i in range(passes):
        one_pass(i)
    end_event.record()
    torch.cuda.synchronize()
    out = {
        "ms_per_pass": round(start_event.elapsed_time(end_event) / passes, 3),
        "distinct_experts": distinct,
        "topk_equal_vllm": equal,
    }
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(passes):
            one_pass(i)
        torch.cuda.synchronize()
    out["kernels_per_pass"] = _kernels(prof, passes)
    return out


if __name__ == "__main__":
    main()
