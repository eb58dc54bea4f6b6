"""GPU microbenchmark of the NVLink pair transport (`afd_ray.connector.nvlink`): the
A2F + F2A round trip per layer, eager and in CUDA graphs, on two GPUs.

`PYTHONPATH=. python3 -m afd_ray.bench.decode_nvlink --out nvlink.json` starts two
processes (rank 0: attention side on GPU 0, rank 1: FFN side on GPU 1; with
`--one-gpu` both on GPU 0, the `cuda_ipc` case of a 1-GPU AFD layout), joined by a
gloo default process group whose store carries the symmetric-memory rendezvous. No
NCCL, Ray, vLLM or ZeroMQ: the transport alone, not yet wired into the decode step.

Two ways to write the rows into the peer's region are measured (`--writes`):
- `copy`: `send_a2f` / `send_f2a` (a copy-engine copy from a local tensor);
- `kernel`: an elementwise kernel writes straight into `a2f_target` / `f2a_target`
  over NVLink (as an FFN's last op could), then `commit_a2f` / `commit_f2a`.

1. Correctness first, for each write mode and T: two ubatch slots per layer (both
   A2F, then both F2A, the DBO order), the FFN side returns `y = 2x + 1` (bf16, the
   same ops on both sides, so equality is exact); the attention side checks every
   layer and slot after one eager step and after 3 replays of one CUDA graph, each
   replay with new random inputs.
2. Timing, as `afd_ray.bench.decode`'s round-trip section: for `T` rows, `[T, H]` bf16,
   L layers of A2F + F2A per step (one slot; the FFN side sends back what it
   received), the step eager and as one CUDA graph per side; µs per layer = median
   step time on the attention rank (CUDA events, host running ahead) / L.

The JSON is written after the correctness check and after each T. Deadlock guards:
every flag wait traps after `--flag-timeout-ms` on the device, each rank dumps its
stack and exits after `--timeout-s`, and the parent stops the other rank when one fails.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from afd_ray.bench.spawn import run_pair
from afd_ray.connector.nvlink import AttentionNVLink, FFNNVLink, SlotLayout
from afd_ray.connector.process_group import registered_gloo_group

__all__ = ["main"]

_DTYPE = torch.bfloat16
_CHECK_REPLAYS = 3
_CHECK_LAYERS = 4
_WRITES = ("copy", "kernel")
Step = Callable[[], None]


def _attention_step(
    link: AttentionNVLink, writes: str, inputs: torch.Tensor, outputs: torch.Tensor | None
) -> Step:
    """L layers of A2F then F2A for every slot; `inputs` `[L, U, T, H]`; F2A rows go
    to `outputs` (same shape) or stay in the region (timing)."""
    layers, ubatches, tokens = inputs.shape[:3]

    def step() -> None:
        for layer in range(layers):
            for u in range(ubatches):
                if writes == "copy":
                    link.send_a2f(inputs[layer, u], u)
                else:
                    torch.mul(inputs[layer, u], 1, out=link.a2f_target(tokens, u))
                    link.commit_a2f(u)
            for u in range(ubatches):
                received = link.recv_f2a(tokens, u)
                if outputs is not None:
                    outputs[layer, u].copy_(received)

    return step


def _ffn_step(link: FFNNVLink, writes: str, layers: int, ubatches: int, tokens: int, affine: bool) -> Step:
    """L layers serving every slot: `y = 2x + 1` (`affine`) or `y = x`, sent back."""

    def step() -> None:
        for _ in range(layers):
            for u in range(ubatches):
                x = link.recv_a2f(tokens, u)
                if writes == "copy":
                    link.send_f2a(x * 2 + 1 if affine else x, u)
                    continue
                target = link.f2a_target(tokens, u)
                if affine:
                    torch.add(x * 2, 1, out=target)
                else:
                    torch.mul(x, 1, out=target)
                link.commit_f2a(u)

    return step


class NVLinkBench:
    """One rank's side (rank 0: attention, rank 1: FFN)."""

    def __init__(self, rank: int, args: argparse.Namespace) -> None:
        self.rank = rank
        self.args = args
        self.device = torch.device("cuda", 0 if args.one_gpu else rank)
        torch.cuda.set_device(self.device)
        self.results: dict = {"failed": {}}
        # The pair's own stateless group over the store, registered by name, as the
        # serving path makes it (the default group serves the bench's barriers).
        store = dist.PrefixStore("afd/pair/0/0", dist.distributed_c10d._get_default_store())
        group_name = "afd-pair-0-0"
        self.pair_group = registered_gloo_group(store, rank, 2, args.timeout_s, group_name)  # registry holds it weakly
        side = AttentionNVLink if rank == 0 else FFNNVLink

        def link(slots: int) -> AttentionNVLink | FFNNVLink:
            layout = SlotLayout(max(args.tokens), args.hidden, slots)
            return side(group_name, layout, _DTYPE, self.device, args.flag_timeout_ms)

        self.check_link = link(2)  # two ubatch slots per layer (the DBO order)
        self.time_link = link(1)

    def log(self, msg: str) -> None:
        print(f"[rank {self.rank}] {msg}", flush=True)

    def write(self) -> None:
        if self.rank == 0:
            Path(self.args.out).write_text(json.dumps(self.results, indent=2))

    def barrier(self) -> None:
        """Both ranks' queued GPU work is done and both reached this point (gloo)."""
        torch.cuda.synchronize()
        dist.barrier()

    def capture(self, step: Step) -> Step | None:
        """`step` as one CUDA graph replay, or None on both ranks if either failed to
        capture (recorded under `graph_failures`). Each side captures alone (capture
        touches no peer), after an eager step has run on both."""
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        error = ""
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                step()
            torch.cuda.synchronize()
        except RuntimeError as exc:  # recorded; the caller skips the graph variant
            traceback.print_exc()
            error = repr(exc)[:1000]
        errors = ["", ""]
        dist.all_gather_object(errors, error)
        if any(errors):
            self.results.setdefault("graph_failures", []).append(errors)
            return None
        return graph.replay

    # -- 1. correctness --------------------------------------------------------------------------------------
    def correctness(self) -> None:
        checks: dict[str, dict[str, dict[str, bool]]] = {}
        generator = torch.Generator(self.device).manual_seed(7)
        for writes in self.args.writes:
            for tokens in self.args.tokens:
                shape = (_CHECK_LAYERS, 2, tokens, self.args.hidden)
                if self.rank == 0:
                    inputs = torch.empty(shape, dtype=_DTYPE, device=self.device)
                    outputs = torch.empty_like(inputs)
                    step = _attention_step(self.check_link, writes, inputs, outputs)
                else:
                    step = _ffn_step(self.check_link, writes, _CHECK_LAYERS, 2, tokens, affine=True)
                results = {}
                for mode in ("eager", "graph"):
                    self.barrier()
                    run = self.capture(step) if mode == "graph" else step
                    self.barrier()
                    if run is None:
                        results[mode] = False
                        continue
                    ok = True
                    for _ in range(_CHECK_REPLAYS if mode == "graph" else 1):
                        if self.rank == 0:
                            inputs.copy_(torch.randn(shape, generator=generator, device=self.device))
                            outputs.fill_(float("nan"))
                        run()
                        torch.cuda.synchronize()
                        if self.rank == 0:
                            ok &= torch.equal(outputs, inputs * 2 + 1)
                    results[mode] = bool(ok)
                checks.setdefault(writes, {})[str(tokens)] = results
                if self.rank == 0:
                    self.log(f"correctness writes={writes} T={tokens}: {results}")
        if self.rank == 0:
            self.results["correctness"] = checks
            self.results["correct"] = all(
                ok for per_t in checks.values() for r in per_t.values() for ok in r.values()
            )

    # -- 2. round trip ---------------------------------------------------------------------------------------
    def roundtrip(self) -> None:
        args = self.args
        steps = args.warmup + 2 * args.iters
        for writes in args.writes:
            suffix = "" if writes == "copy" else "_kernel"
            for tokens in args.tokens:
                if self.rank == 0:
                    x = torch.randn(args.layers, 1, tokens, args.hidden, dtype=_DTYPE, device=self.device)
                    step = _attention_step(self.time_link, writes, x, None)
                else:
                    step = _ffn_step(self.time_link, writes, args.layers, 1, tokens, affine=False)
                for mode in ("eager", "graph"):
                    self.barrier()
                    step()  # warm-up, both sides
                    run = self.capture(step) if mode == "graph" else step
                    self.barrier()
                    if run is None:
                        continue
                    if self.rank == 0:
                        for _ in range(args.warmup):
                            run()
                        gpu_ms, wall_ms = _time_steps(run, args.iters)
                        us = gpu_ms * 1e3 / args.layers
                        key = f"roundtrip_us_{mode}_nvlink{suffix}"
                        self.results.setdefault(key, {})[str(tokens)] = us
                        self.results.setdefault(f"roundtrip_wall_us_{mode}_nvlink{suffix}", {})[
                            str(tokens)
                        ] = wall_ms * 1e3 / args.layers
                        self.log(f"round trip writes={writes} T={tokens} {mode}: {us:.1f} us/layer")
                    else:
                        for _ in range(steps):
                            run()
                    torch.cuda.synchronize()
                self.write()


def _time_steps(step: Step, iters: int) -> tuple[float, float]:
    """Median ms per step: CUDA events with the host running ahead, then wall time
    with a synchronization after each step (as `afd_ray.bench.decode_pair.PairRank.time_steps`)."""
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)
    ]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    gpu = statistics.median(start.elapsed_time(end) for start, end in events)
    wall = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t0) * 1e3)
    return gpu, statistics.median(wall)


def _rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    faulthandler.dump_traceback_later(args.timeout_s, exit=True)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=args.timeout_s),
    )
    bench = NVLinkBench(rank, args)
    bench.results.update(
        {
            "gpu": torch.cuda.get_device_name(bench.device),
            "gpus": 1 if args.one_gpu else 2,
            "mps": os.environ.get("CUDA_MPS_PIPE_DIRECTORY") is not None,
            "torch": torch.__version__,
            "transport": "torch symmetric memory (CUDA backend, multicast off): peer writes + put/wait_signal",
            "symm_mem_backend": os.environ.get("TORCH_SYMMMEM", "CUDA"),
            "dtype": str(_DTYPE),
            "hidden_size": args.hidden,
            "layers": args.layers,
            "args": vars(args),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        }
    )
    with torch.inference_mode():
        for name, fn in (("correctness", bench.correctness), ("roundtrip", bench.roundtrip)):
            start = time.perf_counter()
            try:
                fn()
            except Exception as exc:  # recorded in the JSON; the parent then stops the other rank
                traceback.print_exc()
                bench.results["failed"][f"{name}/rank{rank}"] = repr(exc)[:2000]
                bench.write()
                raise
            bench.log(f"section {name}: {time.perf_counter() - start:.1f} s")
            bench.write()
    bench.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip symmetric-memory and process-group teardown (results are written)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON result file")
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 128, 512], help="rows T per step")
    parser.add_argument("--layers", type=int, default=27, help="round trips per step (and per graph)")
    parser.add_argument("--hidden", type=int, default=2048, help="H of the A2F/F2A tensors")
    parser.add_argument("--writes", nargs="+", choices=_WRITES, default=list(_WRITES))
    parser.add_argument("--iters", type=int, default=20, help="timed steps per variant (median)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--flag-timeout-ms", type=int, default=20_000, help="device-side bound on a flag wait"
    )
    parser.add_argument("--timeout-s", type=float, default=170.0, help="each rank exits after this")
    parser.add_argument(
        "--one-gpu", action="store_true", help="both sides on GPU 0 (two processes on one GPU)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark in two spawned processes; exit status 1 if either failed."""
    args = parse_args(argv)
    if torch.cuda.device_count() < (1 if args.one_gpu else 2):
        raise SystemExit(f"needs {1 if args.one_gpu else 2} CUDA GPUs, found {torch.cuda.device_count()}")
    run_pair(_rank_main, args)


if __name__ == "__main__":
    main()
