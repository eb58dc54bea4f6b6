"""GPU microbenchmark of one MoE layer of the FFN role against its weight-read floor.

`PYTHONPATH=. python3 -m afd_ray.bench.moe_layer --out moe.json` builds one MoE layer
of a DeepSeek-V2-Lite shape (H 2048, 64 routed experts of I 1408, top-6 softmax, 2
shared experts) and of a Qwen3-30B-A3B shape (H 2048, 128 experts of I 768, top-8, no
shared), bfloat16, with random weights N(0, 1/fan_in) (`random_fill`: activations
keep their scale and random rows spread over the experts; `model.load_format: dummy`
gives both roles vLLM's dummy values instead), and runs `MoE.forward` exactly as the
FFN runtime does (gate, routed experts, shared experts on a side stream), one CUDA
graph per T.

1. Correctness first: for each shape and T, the routed experts of vLLM's fused MoE
   kernels (`MoE.routed_fused`, the product path on CUDA) against torch's grouped GEMMs
   in float32 on the same bfloat16 weights (`MoE.routed_grouped`), relative Frobenius
   error; the graph replay against the eager call, and the layer against its parts
   run one after another on one stream (`_serial_layer`), bit for bit.
2. Timing: median of CUDA-event-timed graph replays of the whole layer, fused
   (product), its parts alone (`parts_ms_graph`: serial, route, routed, shared), and
   grouped GEMM (the earlier path), per T.
3. Tile sweep (`--sweep`): the routed experts alone (`routed_fused`) at T = 64, 128 and
   256 under each of a few Triton tile configs (`SWEEP`, passed through vLLM's
   `override_config`), each checked against the default config's output; vLLM ships
   no tuned file for DeepSeek-V2-Lite's (E = 64, N = 1408) on the H200.
4. Floor: the layer's weight bytes (gate, every routed expert, shared experts) over
   the HBM bandwidth measured in the same run (a device-to-device copy of 4 GiB,
   bytes read + written per second). At T >= 64 with top-6 every expert is hit, so
   every weight byte must be read once per layer call.

`--quantization fp8` (`model.quantization: fp8`): the routed experts are quantized to
FP8 once built (`afd_ray.layers.fp8.quantize_experts`, vLLM's dynamic per-tensor FP8
MoE) and run vLLM's FP8 fused MoE kernels; the gate and the shared experts stay
bfloat16, so the floor counts FP8 routed experts (1 byte per weight, plus a float32
scale per expert and projection) and bfloat16 gate and shared experts. The oracle of
step 1 is then the float32 loop on the dequantized FP8 weights (`_FP8_REL_TOLERANCE`:
the activations are quantized to FP8 too), and the grouped GEMM path is not timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DeepseekV2Config, PretrainedConfig, Qwen3MoeConfig
from transformers.activations import ACT2FN

from afd_ray.ffn.model import FFNStack
from afd_ray.layers.fp8 import Fp8Experts, quantize_experts
from afd_ray.layers.moe import MoE
from afd_ray.layers.routing import Routing

__all__ = ["graph_replay", "main", "median_ms", "moe_shapes", "random_fill"]

_DTYPE = torch.bfloat16
_REL_TOLERANCE = 2e-2
"""Bound on ||fused - grouped_fp32|| / ||grouped_fp32|| (bfloat16 GEMM outputs and the
fused kernel's bfloat16 sum of a token's k rows)."""
_FP8_REL_TOLERANCE = 1e-1
"""The same bound with FP8 experts against the float32 loop on their dequantized
weights: the kernel also quantizes its inputs and the gated activations to FP8 per
tensor (3 mantissa bits: about 3% RMS relative error each)."""


def moe_shapes() -> dict[str, PretrainedConfig]:
    """The benchmarked shapes: two decoder layers each (layer 1 is the MoE one)."""
    return {
        "deepseek_v2_lite": DeepseekV2Config(
            hidden_size=2048,
            intermediate_size=10944,
            moe_intermediate_size=1408,
            n_routed_experts=64,
            num_experts_per_tok=6,
            n_shared_experts=2,
            num_hidden_layers=2,
            first_k_dense_replace=1,
            topk_method="greedy",
            n_group=1,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            num_attention_heads=16,
            num_key_value_heads=16,
            vocab_size=1024,
        ),
        "qwen3_30b_a3b": Qwen3MoeConfig(
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            num_hidden_layers=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            num_attention_heads=32,
            num_key_value_heads=4,
            vocab_size=1024,
        ),
    }


def random_fill(target: torch.Tensor, key: str) -> None:
    """Fill a parameter in place with random values seeded by `key`: a matrix
    `[..., fan_in]` with N(0, 1/fan_in), so the activations keep their scale; a vector
    (`e_score_correction_bias`) with zeros."""
    with torch.no_grad():
        if target.dim() < 2:
            target.zero_()
            return
        generator = torch.Generator(target.device).manual_seed(zlib.crc32(key.encode()))
        values = torch.randn(target.shape, generator=generator, device=target.device, dtype=torch.float32)
        target.copy_(values * target.shape[-1] ** -0.5)


def _moe_block(config: PretrainedConfig, device: torch.device, quantization: str | None = None) -> MoE:
    with torch.device("meta"):
        stack = FFNStack(config, _DTYPE)
    stack.to_empty(device=device)
    for (layer, name), target in stack.checkpoint_tensors().items():
        random_fill(target, f"{layer}/{name}")
    block = stack.eval().layers[1]
    assert isinstance(block, MoE)
    if quantization == "fp8":
        block.experts = quantize_experts(block.experts, block.hidden_act)
    return block


def median_ms(fn: Callable[[], object], iters: int) -> float:
    for _ in range(3):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def graph_replay(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """`fn` captured once (after two eager warm-ups on a side stream); the replay and
    its static output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def copy_bandwidth(device: torch.device, gib: int = 4) -> float:
    """Device-to-device copy rate, bytes read + written per second."""
    src = torch.empty(gib << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), 10)
    return 2 * (gib << 30) / (ms / 1e3)


def run(args: argparse.Namespace) -> dict:
    device = torch.device("cuda", 0)
    results: dict = {
        "gpu": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "dtype": str(_DTYPE),
        "quantization": args.quantization,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    try:
        import vllm

        results["vllm_version"] = vllm.__version__
    except ImportError:
        results["vllm_version"] = None
    bandwidth = copy_bandwidth(device)
    results["copy_bandwidth_tb_s"] = bandwidth / 1e12
    generator = torch.Generator(device).manual_seed(0)
    for name, config in moe_shapes().items():
        block = _moe_block(config, device, args.quantization)
        weight_bytes = sum(p.numel() * p.element_size() for p in block.parameters())
        routed_bytes = sum(p.numel() * p.element_size() for p in block.experts.parameters())
        floor_ms = weight_bytes / bandwidth * 1e3
        tolerance = _REL_TOLERANCE if args.quantization is None else _FP8_REL_TOLERANCE
        shape: dict = {
            "weight_bytes": weight_bytes,
            "routed_weight_bytes": routed_bytes,
            "floor_ms": floor_ms,
            "tokens": {},
        }
        results[name] = shape
        for tokens in args.tokens:
            x = torch.randn(tokens, config.hidden_size, generator=generator, device=device).to(_DTYPE)
            with torch.inference_mode():
                routing = block.route(x)
                fused = block.routed_fused(x, routing).double()
                rows = x.float().unsqueeze(1).expand(-1, routing.ids.shape[1], -1).reshape(-1, x.shape[1])
                reference = _float32_experts(block, rows, routing).double()
                rel = float((fused - reference).norm() / reference.norm())
                replay, static = graph_replay(lambda: block(x))
                replay()
                torch.cuda.synchronize()
                eager = block(x)
                graph_equals_eager = bool(torch.equal(static, eager))
                serial_replay, serial = graph_replay(lambda: _serial_layer(block, x))
                serial_replay()
                torch.cuda.synchronize()
                overlap_equals_serial = bool(torch.equal(static, serial))
                fused_ms = median_ms(replay, args.iters)
                parts_ms = {
                    "serial": median_ms(serial_replay, args.iters),
                    "route": median_ms(graph_replay(lambda: block.route(x).weights)[0], args.iters),
                    "routed": median_ms(graph_replay(lambda: block.routed_fused(x, routing))[0], args.iters),
                }
                if block.shared_experts is not None:
                    parts_ms["shared"] = median_ms(graph_replay(lambda: block.shared_experts(x))[0], args.iters)
                grouped_ms = None
                if args.quantization is None:  # FP8 experts have no grouped GEMM path
                    grouped_replay, _ = graph_replay(lambda: _grouped_layer(block, x))
                    grouped_ms = median_ms(grouped_replay, args.iters)
            record = {
                "fused_rel_err_vs_fp32": rel,
                "graph_equals_eager": graph_equals_eager,
                "overlap_equals_serial": overlap_equals_serial,
                "rel_tolerance": tolerance,
                "correct": rel <= tolerance and graph_equals_eager and overlap_equals_serial,
                "layer_ms_fused_graph": fused_ms,
                "parts_ms_graph": parts_ms,
                "layer_ms_grouped_mm_graph": grouped_ms,
                "fused_over_floor": fused_ms / floor_ms,
                "serial_over_floor": parts_ms["serial"] / floor_ms,
                "grouped_mm_over_floor": None if grouped_ms is None else grouped_ms / floor_ms,
            }
            shape["tokens"][str(tokens)] = record
            parts = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in parts_ms.items())
            grouped = "not timed" if grouped_ms is None else f"{grouped_ms * 1e3:.0f} us"
            print(
                f"{name} T={tokens}: rel err {rel:.2e}, graph==eager {graph_equals_eager}, overlap==serial "
                f"{overlap_equals_serial}, fused {fused_ms * 1e3:.0f} us ({fused_ms / floor_ms:.2f}x floor "
                f"{floor_ms * 1e3:.0f} us; parts us: {parts}), grouped_mm {grouped}",
                flush=True,
            )
            Path(args.out).write_text(json.dumps(results, indent=2))
        if args.sweep:
            shape["sweep_routed_ms"] = sweep(block, config.hidden_size, [64, 128, 256], args.iters, device)
            Path(args.out).write_text(json.dumps(results, indent=2))
        block = None  # freed before the next shape's weights are built
        torch.cuda.empty_cache()
    return results


SWEEP: dict[str, dict[str, int]] = {
    name: {"BLOCK_SIZE_M": m, "BLOCK_SIZE_N": n, "BLOCK_SIZE_K": k, "GROUP_SIZE_M": 1, "num_warps": w, "num_stages": st}
    for name, (m, n, k, w, st) in {
        "m16n64k128w4s4": (16, 64, 128, 4, 4),
        "m16n128k128w4s3": (16, 128, 128, 4, 3),
        "m16n128k128w8s3": (16, 128, 128, 8, 3),
        "m32n64k128w4s4": (32, 64, 128, 4, 4),
        "m32n128k128w4s3": (32, 128, 128, 4, 3),
        "m32n128k64w4s4": (32, 128, 64, 4, 4),
        "m64n64k64w4s3": (64, 64, 64, 4, 3),
        "m64n128k64w8s3": (64, 128, 64, 8, 3),
    }.items()
}
"""Triton tile configs of the sweep (after vLLM's tuned H200 files for nearby shapes)."""


def sweep(block: MoE, hidden_size: int, tokens_list: list[int], iters: int, device: torch.device) -> dict:
    """Routed experts' graph time per tile config and T, ms; `default` is vLLM's own choice."""
    from vllm.model_executor.layers.fused_moe import override_config

    out: dict = {}
    generator = torch.Generator(device).manual_seed(1)
    for tokens in tokens_list:
        x = torch.randn(tokens, hidden_size, generator=generator, device=device).to(_DTYPE)
        with torch.inference_mode():
            routing = block.route(x)
            reference = block.routed_fused(x, routing).double()
            timings: dict = {}
            for name, config in {"default": None, **SWEEP}.items():
                try:
                    with override_config(config):
                        got = block.routed_fused(x, routing).double()
                        replay, _ = graph_replay(lambda: block.routed_fused(x, routing))
                        ms = median_ms(replay, iters)
                    rel = float((got - reference).norm() / reference.norm())
                    timings[name] = {"ms": ms, "rel_vs_default": rel}
                except Exception as exc:  # a config the kernel rejects (resources): recorded
                    timings[name] = {"error": repr(exc)[:300]}
            ok = {k: v for k, v in timings.items() if "ms" in v and v["rel_vs_default"] < 1e-2}
            best = min(ok, key=lambda k: ok[k]["ms"])
            out[str(tokens)] = {
                "configs": timings,
                "best": best,
                "best_ms": ok[best]["ms"],
                "default_ms": timings["default"].get("ms"),
            }
            print(
                f"  sweep T={tokens}: default {timings['default'].get('ms', float('nan')) * 1e3:.0f} us, "
                f"best {best} {ok[best]['ms'] * 1e3:.0f} us",
                flush=True,
            )
    return out


def _float32_experts(block: MoE, rows: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Routed experts in float32 (the bfloat16 weights upcast, or FP8 ones dequantized)
    by a loop over experts: `[T, H]` float32, the oracle of `routed_fused`."""
    experts = block.experts
    act_fn = ACT2FN[block.hidden_act]
    top_k = routing.ids.shape[1]
    ids, weights = routing.ids.flatten(), routing.weights.flatten()
    out = torch.zeros_like(rows)
    inter = experts.intermediate_size
    for expert in ids.unique().tolist():
        sel = (ids == expert).nonzero().squeeze(1)
        if isinstance(experts, Fp8Experts):
            w13, w2 = experts.dequantized(expert)  # [2I, H], [H, I] float32
        else:
            w13, w2 = experts.gate_up[expert].float(), experts.down[expert].float()
        gate_up = rows[sel] @ w13.T  # [n, 2I]
        hidden = act_fn(gate_up[:, :inter]) * gate_up[:, inter:]
        out[sel] = (hidden @ w2.T) * weights[sel].unsqueeze(1)
    return out.view(-1, top_k, rows.shape[1]).sum(dim=1)


def _serial_layer(block: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer's parts one after another on one stream (`MoE.forward` without the
    shared experts' side stream): the overlap's reference, bit for bit and in time."""
    routing = block.route(x)
    return block.output(block.routed_fused(x, routing), block.shared(x), x.dtype)


def _grouped_layer(block: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer with torch grouped GEMMs for the routed experts (the earlier path)."""
    routing = block.route(x)
    out = block.routed_grouped(x, routing)
    shared = block.shared(x)
    if shared is not None:
        out += shared
    return out.to(x.dtype)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON result file")
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 64, 128, 256])
    parser.add_argument("--iters", type=int, default=50, help="timed graph replays (median)")
    parser.add_argument("--sweep", action="store_true", help="also time the routed experts per Triton tile config")
    parser.add_argument(
        "--quantization", choices=["fp8"], default=None, help="routed experts in FP8 (model.quantization: fp8)"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    results = run(args)
    ok = all(r["correct"] for name in moe_shapes() for r in results[name]["tokens"].values())
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
