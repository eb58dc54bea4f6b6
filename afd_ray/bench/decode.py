"""GPU decode benchmark: the AFD data plane against colocated serving, on two devices.

`PYTHONPATH=. python3 -m afd_ray.bench.decode --out result.json` starts two processes
(rank 0 on device 0, rank 1 on device 1). Rank 1 is the FFN role and rank 0 the
attention role of a 1A:1F pair, joined by the project's connector
(`afd_ray.connector.channel`: ZeroMQ step headers, NCCL pair groups, one per ubatch).
Nothing here imports Ray or vLLM: the attention role is `decode_models.AttentionStage`
(real attention kernels over a static KV cache), the FFN role is
`afd_ray.ffn.model.FFNStack` with random weights.

Sections, each written to the JSON as soon as it is done:
1. `p2p`: NCCL point-to-point bulk bandwidth on a bare pair group (1 GiB), and bulk
   A2F through the connector (`[65536, H]` bf16), as a share of it.
2. `roundtrip`: A2F + F2A per layer for `T` rows, `[T, H]` bf16, over L layers of a
   step (FFN side sends back what it received), eager and in one CUDA graph per side
   and step; µs per layer = median step time on the attention rank / L.
3. per model: a correctness check (the AFD step, eager and in graphs, DBO off and on,
   against the colocated step on the same GPU with the same weights, bitwise copied:
   relative error of the final hidden states and agreement of the greedy tokens), then
   per batch: attention alone, FFN alone, AFD (DBO off/on), colocated on one GPU, and
   colocated on two GPUs (data-parallel attention + EP2 over an NCCL group, each GPU a
   batch of B), every step in CUDA graphs.

Times: CUDA events around each step with the host running ahead (`gpu_ms`, medians),
and wall time of a step followed by a device synchronization (`step_ms`, medians;
TPOT: the engine needs the sampled tokens each step). Headers travel outside graphs.
Tokens/s per GPU = B / step / GPUs used (AFD 1A:1F: 2 GPUs; colocated: 1 or 2 with 2B
in flight). Decode inputs are random (weights, KV cache, token ids), never zeros; each
step feeds its greedy tokens to the next.

Code: `decode_pair` (one rank's plumbing), `decode_connector` (sections 1-2),
`decode_steps` and `decode_layouts` (section 3), `decode_summary` (derived figures),
`decode_models` (model shapes, attention stage), `spawn` (the two processes).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from afd_ray.bench.decode_connector import ConnectorSections
from afd_ray.bench.decode_layouts import ModelSections
from afd_ray.bench.decode_models import MODELS
from afd_ray.bench.decode_summary import summarize
from afd_ray.bench.spawn import run_pair

__all__ = ["main"]


class Bench(ConnectorSections, ModelSections):
    """One rank's side of the benchmark (rank 0: attention, rank 1: FFN): every section."""


def _rank_main(rank: int, args: argparse.Namespace, store_port: int) -> None:
    bench = Bench(rank, args, store_port)
    if rank == 0:
        props = torch.cuda.get_device_properties(0) if bench.cuda else None
        bench.results.update(
            {
                "gpu": torch.cuda.get_device_name(0) if bench.cuda else "cpu",
                "gpus": 2,
                "gpu_memory_bytes": props.total_memory if props else None,
                "torch": torch.__version__,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())) if bench.cuda else None,
                "backend": bench.backend,
                "dtype": str(bench.dtype),
                "args": {k: v for k, v in vars(args).items()},
                "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            }
        )
        bench.write()
    with torch.inference_mode():
        for name, fn in (("p2p", bench.p2p), ("roundtrip", bench.roundtrip)):
            if name in args.sections:
                bench.section(name, fn)
        if "models" in args.sections:
            for model in args.models:
                spec = MODELS[model](args.tiny)
                bench.section(spec.name, lambda spec=spec: bench.model(spec))
                if rank == 0:
                    summarize(bench.results, args.tpot_budget_ms)
                    bench.write()
    bench.barrier()
    if rank == 1:
        bench.store.set("done", "1")
    else:
        bench.store.get("done")  # rank 0 hosts the store: it leaves last
    sys.stdout.flush()
    os._exit(0)  # skip process-group teardown at interpreter exit (results are written)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON result file")
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cuda: NCCL; cpu: gloo (smoke)"
    )
    parser.add_argument("--tiny", action="store_true", help="tiny model shapes (CPU smoke)")
    parser.add_argument(
        "--models", nargs="+", choices=sorted(MODELS), default=["deepseek-v2-lite", "qwen3-30b-a3b"]
    )
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=("p2p", "roundtrip", "models"),
        default=["p2p", "roundtrip", "models"],
    )
    parser.add_argument(
        "--batches", nargs="+", type=int, default=[32, 64, 128, 256, 512], help="per attention rank"
    )
    parser.add_argument("--context", type=int, default=4096, help="KV positions per sequence")
    parser.add_argument("--kv-budget-gib", type=int, default=96, help="most GiB of KV buffers per GPU")
    parser.add_argument("--reserve-gib", type=int, default=16, help="GiB left free beside the KV buffers")
    parser.add_argument("--roundtrip-tokens", nargs="+", type=int, default=[1, 16, 128, 512])
    parser.add_argument("--roundtrip-layers", type=int, default=27)
    parser.add_argument("--hidden-a2f", type=int, default=2048, help="H of the round-trip and bulk tensors")
    parser.add_argument("--iters", type=int, default=20, help="timed steps per variant (median)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tpot-budget-ms", type=float, default=50.0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark in two spawned processes; exit status 1 if either failed."""
    args = parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        raise SystemExit(f"--device cuda needs 2 GPUs, found {torch.cuda.device_count()}")
    run_pair(_rank_main, args)


if __name__ == "__main__":
    main()
