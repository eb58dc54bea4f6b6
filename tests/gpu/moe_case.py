"""The GPU tests' MoE case: a DeepSeek-V2-Lite-like layer stack at half width, its
float32 CPU reference, and the worker that runs one FFN rank on one GPU.

Imports neither Ray nor vLLM (the GPU machine has neither). Weights and inputs are
random and rounded to bfloat16-representable values, so the bfloat16 CUDA run and
the float32 reference see the same numbers and differ only by compute precision.
"""

from __future__ import annotations

import faulthandler
import json
import os
import time
import zlib
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import DeepseekV2Config

from afd_ray.connector.process_group import new_process_group
from afd_ray.ffn.ep import EPGroup
from afd_ray.ffn.graphs import FFNGraphs, ffn_layer
from afd_ray.ffn.model import FFNStack
from afd_ray.layers.moe import MoE
from afd_ray.devices import torch_device
from afd_ray.platform import collective_backend

SEED = 0
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
"""Captured row counts per FFN rank; steps above 128 rows run eagerly."""
STEPS = [(1, 1), (5, 3), (0, 7), (16, 16), (64, 40), (100, 128), (300, 200)]
"""Token counts of EP ranks 0 and 1 in each step (one GPU serves their sum): exact
buckets, padded ones, an idle rank, and steps beyond the largest bucket."""
HANG_DUMP_S = 60
"""A spawned rank still running after this many seconds prints its stack and exits."""
REL_TOLERANCE = 1e-2
"""Bound on ||out - ref||_F / ||ref||_F (Frobenius norms over a rank's rows of one layer)."""
NVLINK_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def moe_config() -> DeepseekV2Config:
    """DeepSeek-V2-Lite's FFN at half width: 64 routed experts, top-6 greedy softmax
    routing, 2 shared experts; 3 layers, the first dense."""
    return DeepseekV2Config(
        hidden_size=1024,
        intermediate_size=2816,
        moe_intermediate_size=704,
        n_routed_experts=64,
        num_experts_per_tok=6,
        n_shared_experts=2,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=256,
    )


def _init_tensor(layer: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Checkpoint tensor `(layer, name)`: N(0, 1/fan_in), bfloat16-representable float32,
    the same in every process (seeded by its name)."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{SEED}/{layer}/{name}".encode()))
    return (torch.randn(shape, generator=generator) * shape[-1] ** -0.5).to(torch.bfloat16).float()


def build_stack(
    dtype: torch.dtype, device: torch.device, ep_rank: int = 0, ep_size: int = 1, gate_on_attention: bool = True
) -> FFNStack:
    """The case's FFN stack (only this EP rank's experts), weights from `_init_tensor`."""
    with torch.device("meta"):
        stack = FFNStack(moe_config(), dtype, ep_rank, ep_size, gate_on_attention)
    stack.to_empty(device=device)
    with torch.no_grad():
        for (layer, name), target in stack.checkpoint_tensors().items():
            target.copy_(_init_tensor(layer, name, tuple(target.shape)))
    return stack.eval()


def write_reference(path: Path) -> Path:
    """Inputs and float32 CPU reference outputs of every decoder layer for `STEPS`.

    Saved with `torch.save`: a list over steps of `{"counts": (n0, n1), "layers":
    [{"x": [N, H], "ids": [N, k] | None, "weights": [N, k] | None, "ref": [N, H]}]}`,
    N = n0 + n1, float32; the routing is the reference gate's (gate_on_ffn stack).
    """
    reference = build_stack(torch.float32, torch.device("cpu"), gate_on_attention=False)
    generator = torch.Generator().manual_seed(SEED)
    steps = []
    with torch.inference_mode():
        for counts in STEPS:
            layers = []
            for block in reference.layers:
                x = torch.randn(sum(counts), reference.hidden_size, generator=generator).to(torch.bfloat16).float()
                if isinstance(block, MoE):
                    routing = block.route(x)
                    layers.append({"x": x, "ids": routing.ids, "weights": routing.weights, "ref": block(x, routing)})
                else:
                    layers.append({"x": x, "ids": None, "weights": None, "ref": block(x)})
            steps.append({"counts": counts, "layers": layers})
    torch.save(steps, path)
    return path


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref||_F / ||ref||_F in float64 (0 for empty tensors)."""
    if ref.numel() == 0:
        return 0.0
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm())


def _median_us(fn: Callable[[], object], iters: int = 20) -> float:
    """Median wall time of `fn()` on the current stream, microseconds (CUDA events)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def _timing(graphs: FFNGraphs, model: FFNStack, ep: EPGroup | None) -> dict[int, dict[str, float]]:
    """Median time of the first MoE layer per bucket, graph replay and eager (every EP
    rank runs the same calls)."""
    layer = next(i for i, block in enumerate(model.layers) if isinstance(block, MoE))
    timing = {}
    for bucket in (1, 16, 128):
        inputs = graphs.inputs(bucket)
        timing[bucket] = {
            "graph_us": _median_us(partial(graphs.run, layer, inputs)),
            "eager_us": _median_us(partial(ffn_layer, model, ep, layer, inputs.hidden, inputs.routing)),
        }
    return timing


def _run_steps(model: FFNStack, ep: EPGroup | None, case: list[dict], rank: int, world: int) -> dict:
    """Every step of `case` on this rank through `FFNGraphs`: for each layer the graph
    (or eager fallback) output, the eager output on the same padded buffers, and the
    error against the reference. Layer i of `model` is decoder layer `layer_ids[i]`."""
    dtype = torch.bfloat16
    start = time.perf_counter()
    graphs = FFNGraphs(model, ep, dtype, BUCKETS)
    torch.cuda.synchronize()
    records = {"capture_s": time.perf_counter() - start, "layers": []}
    _progress(rank, f"captured {len(BUCKETS)} buckets x {model.num_layers} layers")
    for step in case:
        counts = step["counts"]
        tokens, offset = (counts[rank], sum(counts[:rank])) if world > 1 else (sum(counts), 0)
        rows = tokens
        if ep is not None:
            assert ep.agree(tokens) == sum(counts)
            assert ep.step_tokens == tuple(counts)
            rows = max(ep.step_tokens)
        inputs = graphs.inputs(rows)
        for i, decoder_layer in enumerate(model.layer_ids):
            data = {
                k: v if v is None else v[offset : offset + tokens] for k, v in step["layers"][decoder_layer].items()
            }
            inputs.hidden[:tokens].copy_(data["x"])
            if inputs.routing is not None:
                inputs.routing.ids[:tokens].copy_(data["ids"])
                inputs.routing.weights[:tokens].copy_(data["weights"])
            graphed = graphs.run(i, inputs)
            out, ids = graphed.out[:tokens].clone(), None if graphed.ids is None else graphed.ids[:tokens].clone()
            eager = ffn_layer(model, ep, i, inputs.hidden, inputs.routing)
            records["layers"].append(
                {
                    "counts": list(counts),
                    "decoder_layer": decoder_layer,
                    "rows": rows,
                    "bucket": inputs.bucket,
                    "graph_equals_eager": torch.equal(out, eager.out[:tokens])
                    and (ids is None or torch.equal(ids, eager.ids[:tokens])),
                    "rel_err": rel_err(out, data["ref"]),
                    "ids_match_ref": None if ids is None else bool(torch.equal(ids.cpu(), data["ids"])),
                }
            )
    records["moe_layer_timing"] = _timing(graphs, model, ep)
    del graphs
    torch.cuda.synchronize()
    return records


def _progress(rank: int, what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} rank {rank}] {what}", flush=True)


def run_rank(rank: int, world: int, store_port: int, case_path: str, out_dir: str) -> None:
    """One FFN rank on GPU `rank` (`mp.spawn` target): with `world` > 1 it joins an
    NCCL EP group of `world` ranks through the TCPStore at `store_port`. Runs the gate_on_attention bfloat16 stack (its EP
    shard) and, on one GPU, also the gate_on_ffn stack (routing and the dense layer in
    the graphs), and writes `rank{rank}.json` to `out_dir`."""
    for name, value in NVLINK_MULTICAST_OFF.items():
        os.environ.setdefault(name, value)
    if world > 1:
        faulthandler.dump_traceback_later(HANG_DUMP_S, exit=True)  # a hung rank shows where, then exits
    torch.cuda.set_device(rank)
    device = torch_device("cuda")  # the current device
    case = torch.load(case_path)
    ep = None
    if world > 1:
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=120))
        group = new_process_group(collective_backend("cuda"), dist.PrefixStore("ep", store), rank, world, 120)
        ep = EPGroup(group, moe_config().n_routed_experts, device)
    _progress(rank, "joined" if ep is not None else "started")
    results = {"rank": rank, "world": world, "device": torch.cuda.get_device_name(device)}
    with torch.inference_mode():
        model = build_stack(torch.bfloat16, device, rank, world, gate_on_attention=True)
        _progress(rank, "model built")
        results["gate_on_attention"] = _run_steps(model, ep, case, rank, world)
        _progress(rank, f"gate_on_attention done (capture {results['gate_on_attention']['capture_s']:.1f} s)")
        del model
        if world == 1:
            model = build_stack(torch.bfloat16, device, gate_on_attention=False)
            results["gate_on_ffn"] = _run_steps(model, None, case, rank, world)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    if ep is not None:  # as FFNRuntime's layout switch does, after the graphs that captured it are freed
        ep.group.shutdown()
        _progress(rank, "EP group shut down")
        faulthandler.cancel_dump_traceback_later()
