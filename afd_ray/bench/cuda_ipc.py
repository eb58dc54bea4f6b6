"""GPU microbenchmark of the `cuda_ipc` pair transport (`afd_ray.connector.cuda_ipc`):
two processes on ONE GPU, the serving path's data plane, no Ray or vLLM.

`PYTHONPATH=. python3 -m afd_ray.bench.cuda_ipc --out cuda_ipc.json` spawns an
attention side and an FFN side, both on cuda:0, paired through a `TCPStore` as the
serving path pairs them (`open_cuda_ipc_pair`).

1. Correctness first, per T: for L layers the attention side sends hidden `[T, H]`
   bf16 plus top-k ids `[T, k]` int64 and weights `[T, k]` float32 (gate_on_attention's
   message); the FFN side answers `2 * hidden + 1` and the attention side checks every
   byte, eagerly and over 3 replays of one CUDA graph per side, new inputs each replay;
   the FFN side checks the top-k bytes it received.
2. Timing: the round trip per layer (A2F `[T, H]` + F2A `[T, H]`, the FFN echoing
   what it received), L layers per step, each side's step as one CUDA graph; us per
   layer = median step time on the attention side (CUDA events) / L.

Run it under NVIDIA MPS for microsecond figures (docs/cuda.md and `deployments/afd-cuda.yaml`
say why); the JSON records whether `CUDA_MPS_PIPE_DIRECTORY` was set.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from afd_ray.connector.cuda_ipc import open_cuda_ipc_pair

__all__ = ["main"]

_DTYPE = torch.bfloat16
_TOP_K = 6
_REPLAYS = 3


def _graph(step: Callable[[], None]) -> Callable[[], None]:
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def _side(rank: int, args: argparse.Namespace, port: int, queue: mp.Queue) -> None:
    faulthandler.dump_traceback_later(args.timeout_s, exit=True)
    side = "ffn" if rank == 0 else "attention"
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, timeout=timedelta(seconds=60))
    pair = open_cuda_ipc_pair(side, dist.PrefixStore("afd/pair/0/0", store), peer=0, ubatches=1, timeout_s=30)
    results: dict = {"correct": {}, "roundtrip_us_graph": {}, "roundtrip_us_eager": {}}
    hidden_size, layers = args.hidden, args.layers
    gen = torch.Generator(device).manual_seed(1)
    with torch.inference_mode():
        for tokens in args.tokens:
            # -- correctness: L layers, hidden + top-k out, 2x+1 back -------------------------------
            x = torch.zeros(layers, tokens, hidden_size, dtype=_DTYPE, device=device)
            ids = torch.zeros(layers, tokens, _TOP_K, dtype=torch.int64, device=device)
            weights = torch.zeros(layers, tokens, _TOP_K, dtype=torch.float32, device=device)
            y = torch.zeros_like(x)

            def attention_step() -> None:
                for layer in range(layers):
                    pair.exchange([x[layer], ids[layer], weights[layer]], [y[layer]], 0)

            def ffn_step() -> None:
                for layer in range(layers):
                    pair.recv([x[layer], ids[layer], weights[layer]], 0)
                    pair.send([x[layer] * 2 + 1], 0)

            step = attention_step if side == "attention" else ffn_step
            ok = True
            for mode in ("eager", "graph"):
                store.set(f"ready/{tokens}/{mode}/{side}", "1")
                store.wait([f"ready/{tokens}/{mode}/{other}" for other in ("ffn", "attention")])
                run = step
                if mode == "graph":
                    step()  # warm-up (both sides), then capture alone
                    torch.cuda.synchronize()
                    run = _graph(step)
                for _ in range(_REPLAYS if mode == "graph" else 1):
                    if side == "attention":
                        x.copy_(torch.randn(x.shape, generator=gen, device=device))
                        ids.copy_(torch.randint(0, 1 << 40, ids.shape, generator=gen, device=device))
                        weights.copy_(torch.rand(weights.shape, generator=gen, device=device))
                        y.fill_(float("nan"))
                        store.set(f"sent/{tokens}/{mode}", json.dumps([int(ids.sum()), float(weights.sum())]))
                    run()
                    torch.cuda.synchronize()
                    if side == "attention":
                        ok &= bool(torch.equal(y, x * 2 + 1))
                    else:
                        want = json.loads(store.get(f"sent/{tokens}/{mode}"))
                        ok &= [int(ids.sum()), float(weights.sum())] == want
            results["correct"][str(tokens)] = ok
            # -- timing: echo, one graph per side ------------------------------------------------------
            xs = torch.randn(layers, tokens, hidden_size, generator=gen, device=device).to(_DTYPE)
            ys = torch.empty_like(xs)

            def attention_time() -> None:
                for layer in range(layers):
                    pair.exchange([xs[layer]], [ys[layer]], 0)

            def ffn_time() -> None:
                for layer in range(layers):
                    pair.recv([xs[layer]], 0)
                    pair.send([xs[layer]], 0)

            step = attention_time if side == "attention" else ffn_time
            for mode in ("eager", "graph"):
                store.set(f"time/{tokens}/{mode}/{side}", "1")
                store.wait([f"time/{tokens}/{mode}/{other}" for other in ("ffn", "attention")])
                step()
                torch.cuda.synchronize()
                run = _graph(step) if mode == "graph" else step
                for _ in range(args.warmup):
                    run()
                events = [
                    (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                    for _ in range(args.iters)
                ]
                for start, end in events:
                    start.record()
                    run()
                    end.record()
                torch.cuda.synchronize()
                us = statistics.median(s.elapsed_time(e) for s, e in events) * 1e3 / layers
                results[f"roundtrip_us_{mode}"][str(tokens)] = us
                if side == "attention":
                    print(f"cuda_ipc T={tokens} {mode}: {us:.1f} us/layer, correct {ok}", flush=True)
    store.set(f"done/{side}", "1")
    store.wait(["done/ffn", "done/attention"])
    pair.close()
    queue.put((side, results))
    queue.close()
    queue.join_thread()  # the result reaches the parent before this process ends
    sys.stdout.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 128])
    parser.add_argument("--layers", type=int, default=27)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=150.0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    context = mp.get_context("spawn")
    queue = context.Queue()
    with __import__("socket").socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [context.Process(target=_side, args=(rank, args, port, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    got = {}
    deadline = time.monotonic() + args.timeout_s + 10
    while len(got) < 2 and time.monotonic() < deadline:
        try:
            side, res = queue.get(timeout=1)
            got[side] = res
        except Exception:  # queue.Empty; a dead side ends the wait below
            if any(p.exitcode not in (None, 0) for p in procs):
                break
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.terminate()
    attention = got.get("attention", {})
    ffn = got.get("ffn", {})
    correct = (
        bool(attention.get("correct"))
        and all(attention["correct"].values())
        and all(ffn.get("correct", {"x": False}).values())
    )
    result = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "transport": "cuda_ipc (afd_ray.connector.cuda_ipc): two processes on one GPU",
        "mps": os.environ.get("CUDA_MPS_PIPE_DIRECTORY") is not None,
        "hidden_size": args.hidden,
        "layers": args.layers,
        "dtype": str(_DTYPE),
        "correct": correct,
        "correct_attention": attention.get("correct"),
        "correct_ffn": ffn.get("correct"),
        "roundtrip_us_graph": attention.get("roundtrip_us_graph"),
        "roundtrip_us_eager": attention.get("roundtrip_us_eager"),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    raise SystemExit(0 if correct else 1)


if __name__ == "__main__":
    main()
