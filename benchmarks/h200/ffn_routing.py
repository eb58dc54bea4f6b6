"""Why the FFN role's step took longer than plain vLLM's whole step (issue 13): the
routing of dummy weights, FFN role against plain vLLM, on the rows plain vLLM's MoE
blocks see. One H200, after the device pack is installed:

    PYTHONPATH=.:/tmp/site python3 benchmarks/h200/ffn_routing.py --out OUT/ffn_routing.json

1. Plain vLLM (in process, eager, `load_format="dummy"`, bf16) on the DeepSeek-V2-Lite
   shape (`afd_ray.models.shapes`), the bench's prompts (4096 token ids per stream,
   `afd_ray.bench.runner._prompts` seeds), greedy, for 16 and then 64 streams. A
   forward pre-hook on every `DeepseekV2MoE` keeps its input rows of decode steps
   (T = streams). Per step: distinct generated tokens; per MoE layer and step: the
   distinct experts vLLM's own routing picks (`mlp.gate`, then vLLM's `grouped_topk`).
2. The FFN role's stack (`afd_ray.ffn.model.load_ffn_stack(random_weights=True)`) on
   the same rows, with the product's fill (`dummy_fill`, vLLM's dummy values) and with
   the fill it had before (N(0, 1/fan_in) per checkpoint tensor,
   `afd_ray.bench.moe_layer.random_fill`): distinct experts per layer and step, and
   for `dummy_fill` whether its top-k equals vLLM's on every row.
3. Timing (after those checks): the FFN role's per-bucket CUDA graphs
   (`afd_ray.ffn.graphs.FFNGraphs`, what `FFNRuntime` replays) over all 27 layers,
   rows written into the static buffers per layer as the A2F receive does; median ms
   per pass over the recorded decode steps, at T = 16 and 64, on the recorded rows and
   on random rows (N(0, 1) scaled to the recorded rows' RMS: routing spread as over
   diverse tokens). Plus vLLM's own MoE block (`model.layers[l].mlp`, eager, in vLLM's
   forward context) on the recorded rows for reference, where it can run outside the
   model runner.

Prints a short table last; writes JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch

from afd_ray.bench.config import BenchConfig
from afd_ray.bench.moe_layer import random_fill
from afd_ray.bench.runner import _prompts
from afd_ray.ffn.graphs import FFNGraphs
from afd_ray.ffn.model import FFNStack, load_ffn_stack
from afd_ray.layers.moe import MoE
from afd_ray.models.shapes import build_shape

SHAPE = "deepseek-v2-lite"
STREAMS = (16, 64)
_RECORDS: dict[int, dict[int, list[torch.Tensor]]] = {}
"""streams -> decoder layer -> recorded decode-step input rows `[T, H]` bf16 (GPU)."""
_MODEL: list[torch.nn.Module] = []
"""The in-process engine's model (`LLM.apply_model`)."""


def _hook_moe(model: torch.nn.Module, streams: int, max_steps: int) -> list[str]:
    names = []
    for name, module in model.named_modules():
        if type(module).__name__ != "DeepseekV2MoE":
            continue
        layer = int(name.split("layers.")[1].split(".")[0])
        rows = _RECORDS.setdefault(streams, {}).setdefault(layer, [])

        def pre(mod: torch.nn.Module, args: tuple, rows: list = rows) -> None:
            hidden = args[0]
            if hidden.shape[0] == streams and len(rows) < max_steps:
                rows.append(hidden.detach().clone())

        module._afd_hook = module.register_forward_pre_hook(pre)  # type: ignore[attr-defined]
        names.append(name)
    return names


def _unhook(model: torch.nn.Module) -> None:
    for module in model.modules():
        hook = getattr(module, "_afd_hook", None)
        if hook is not None:
            hook.remove()
            del module._afd_hook


def _vllm_topk(model: torch.nn.Module, layer: int, rows: torch.Tensor, top_k: int) -> torch.Tensor:
    """vLLM's own routing of `rows`: its gate, then its `grouped_topk` (what DeepSeek-V2's
    `GroupedTopKRouter` runs: softmax and top-k in the logits' dtype)."""
    from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import grouped_topk

    mlp = model.model.layers[layer].mlp
    logits = mlp.gate(rows)
    logits = logits[0] if isinstance(logits, tuple) else logits
    route = getattr(grouped_topk, "_torchdynamo_orig_callable", grouped_topk)
    _, ids = route(rows, logits, top_k, False, 1, 1, "softmax", 1.0, None)
    return ids.long().sort(-1).values


def _distinct(ids: torch.Tensor) -> int:
    return int(ids.unique().numel())


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 3) if values else float("nan")


@torch.inference_mode()
def _time_stack(stack: FFNStack, steps: list[dict[int, torch.Tensor]], rows: int, iters: int) -> float:
    """Median ms of one pass over every layer of `stack` through `FFNGraphs` (bucket
    `rows`), writing each layer's rows into the static buffers first."""
    compute = FFNGraphs(stack, None, torch.bfloat16, buckets=(rows,))
    inputs = compute.inputs(rows)
    times = []
    for i in range(iters + 3):
        step = steps[i % len(steps)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for layer in range(stack.num_layers):
            inputs.hidden[:rows].copy_(step[layer])
            compute.run(layer, inputs)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    del compute
    return _median(times)


def _steps(records: dict[int, list[torch.Tensor]], num_layers: int) -> list[dict[int, torch.Tensor]]:
    """Per recorded decode step, each layer's rows (a dense layer, not recorded, takes
    the first MoE layer's)."""
    count = min(len(v) for v in records.values())
    first = min(records)
    return [{layer: records.get(layer, records[first])[s] for layer in range(num_layers)} for s in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: hooks see its model
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model's functions
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    folder = build_shape(SHAPE, Path("/tmp/afd-routing") / SHAPE)
    cfg = BenchConfig(platform="cuda", prompt_tokens=4096, max_model_len=4352, seed=0)
    result: dict = {"gpu": torch.cuda.get_device_name(0), "shape": SHAPE, "streams": {}}
    llm = LLM(
        model=str(folder),
        dtype="bfloat16",
        load_format="dummy",
        enforce_eager=True,
        max_model_len=4352,
        gpu_memory_utilization=0.45,
        max_num_seqs=64,
        seed=0,
    )
    result["vllm_start_s"] = round(time.perf_counter() - t0, 1)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    tokens: dict[int, list[list[int]]] = {}
    # Warm-up: every prompt prefilled once, so each measured round starts decoding all
    # its streams together from the prefix cache (as the bench's warm-up round does).
    warm = [{"prompt_token_ids": ids} for ids in _prompts(cfg, folder, max(STREAMS))]
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    result["warm_s"] = round(time.perf_counter() - t0, 1)
    for streams in STREAMS:
        llm.apply_model(lambda model, s=streams: _hook_moe(model, s, args.new_tokens))
        prompts = [{"prompt_token_ids": ids} for ids in _prompts(cfg, folder, streams)]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens[streams] = [list(o.outputs[0].token_ids) for o in outputs]
        llm.apply_model(_unhook)
    llm.apply_model(_MODEL.append)
    model = _MODEL.pop()
    top_k = 6
    vllm_ids: dict[int, dict[int, list[torch.Tensor]]] = {}
    for streams in STREAMS:
        per_step = [len({t[s] for t in tokens[streams]}) for s in range(args.new_tokens)]
        records = _RECORDS[streams]
        with torch.inference_mode():
            vllm_ids[streams] = {
                layer: [_vllm_topk(model, layer, rows, top_k) for rows in steps] for layer, steps in records.items()
            }
        result["streams"][str(streams)] = {
            "decode_steps_recorded": min(len(v) for v in records.values()),
            "distinct_tokens_per_step": per_step,
            "vllm_distinct_experts_median": _median([_distinct(i) for v in vllm_ids[streams].values() for i in v]),
            "row_rms": float(torch.stack([r.float().pow(2).mean() for v in records.values() for r in v]).mean().sqrt()),
        }
    # vLLM's own MoE block on the recorded rows (eager, vLLM's forward context), for reference.
    try:
        from vllm.forward_context import set_forward_context

        vllm_config = llm.llm_engine.vllm_config
        with torch.inference_mode(), set_forward_context(None, vllm_config):
            for streams in STREAMS:
                records = _RECORDS[streams]
                times = []
                for i in range(args.iters + 3):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for layer, steps in records.items():
                        model.model.layers[layer].mlp(steps[i % len(steps)])
                    end.record()
                    torch.cuda.synchronize()
                    if i >= 3:
                        times.append(start.elapsed_time(end))
                result["streams"][str(streams)]["vllm_moe_blocks_eager_ms"] = _median(times)
    except Exception as exc:  # reference only: report why it could not run
        result["vllm_moe_blocks_error"] = f"{type(exc).__name__}: {exc}"[:400]
    # Keep the rows on the GPU, drop the engine.
    del model, llm
    gc.collect()
    from vllm.distributed import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
    torch.cuda.empty_cache()

    device = torch.device("cuda", 0)
    fills = {}
    for fill in ("dummy_fill", "old_random_fill"):
        stack = load_ffn_stack(folder, torch.bfloat16, device, random_weights=True)
        if fill == "old_random_fill":
            for (layer, name), target in stack.checkpoint_tensors().items():
                random_fill(target, f"{layer}/{name}")
        entry: dict = {}
        for streams in STREAMS:
            records = _RECORDS[streams]
            counts, equal_rows, total_rows = [], 0, 0
            with torch.inference_mode():
                for layer, steps in records.items():
                    block = stack.layers[layer]
                    assert isinstance(block, MoE)
                    for s, rows in enumerate(steps):
                        ids = block.route(rows).ids.sort(-1).values
                        counts.append(_distinct(ids))
                        equal_rows += int((ids == vllm_ids[streams][layer][s]).all(-1).sum())
                        total_rows += rows.shape[0]
            rms = result["streams"][str(streams)]["row_rms"]
            recorded = _steps(records, stack.num_layers)
            with torch.inference_mode():
                random_steps = [
                    {layer: torch.randn_like(rows) * rms for layer, rows in step.items()} for step in recorded[:4]
                ]
            entry[str(streams)] = {
                "distinct_experts_median": _median(counts),
                "topk_equal_to_vllm_rows": f"{equal_rows}/{total_rows}",
                "stack_ms_recorded_rows": _time_stack(stack, recorded, streams, args.iters),
                "stack_ms_random_rows": _time_stack(stack, random_steps, streams, args.iters),
            }
            with torch.inference_mode():
                spread = [
                    _distinct(stack.layers[layer].route(rows).ids)
                    for step in random_steps
                    for layer, rows in step.items()
                    if isinstance(stack.layers[layer], MoE)
                ]
            entry[str(streams)]["distinct_experts_random_rows_median"] = _median(spread)
        fills[fill] = entry
        del stack
        gc.collect()
        torch.cuda.empty_cache()
    result["ffn"] = fills
    result["elapsed_s"] = round(time.perf_counter() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "ffn"}, indent=None)[:3000])
    print(
        f"{'fill':16} {'T':>3} {'experts vLLM':>12} {'experts FFN':>11} {'rand':>5} {'topk=vLLM':>12} "
        f"{'ms rec':>7} {'ms rand':>7}"
    )
    for fill, entry in fills.items():
        for streams, e in entry.items():
            v = result["streams"][streams]["vllm_distinct_experts_median"]
            print(
                f"{fill:16} {streams:>3} {v:>12} {e['distinct_experts_median']:>11} "
                f"{e['distinct_experts_random_rows_median']:>5} {e['topk_equal_to_vllm_rows']:>12} "
                f"{e['stack_ms_recorded_rows']:>7} {e['stack_ms_random_rows']:>7}"
            )


if __name__ == "__main__":
    main()
