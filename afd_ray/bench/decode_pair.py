"""One rank of the GPU decode benchmark's pair (`afd_ray.bench.decode`): its process
groups and connector channel, and the helpers every section uses (barrier, graph
capture, step timing, serving step headers, writing the JSON).

Rank 0 is the attention role (an `AttentionChannel`), rank 1 the FFN role (an
`FFNChannel`); both share a TCPStore hosted by rank 0, an `aux` pair group (bulk
transfers, weight copies) and an `ep` pair group (EP2 of the colocated 2-GPU layout).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from afd_ray.connector.channel import AttentionChannel, FFNAddress, FFNChannel
from afd_ray.connector.header import HeaderKind
from afd_ray.connector.process_group import new_process_group

__all__ = ["PairRank"]

_TIMEOUT_S = 120.0
_DTYPE = {"cuda": torch.bfloat16, "cpu": torch.float32}


class PairRank:
    """One rank's side of the benchmark (rank 0: attention, rank 1: FFN): plumbing only."""

    def __init__(self, rank: int, args: argparse.Namespace, store_port: int) -> None:
        self.rank = rank
        self.args = args
        self.cuda = args.device == "cuda"
        self.backend = "nccl" if self.cuda else "gloo"
        self.dtype = _DTYPE[args.device]
        if self.cuda:
            torch.cuda.set_device(rank)
            self.device = torch.device("cuda", rank)
        else:
            self.device = torch.device("cpu")
        self.store = dist.TCPStore(
            "127.0.0.1", store_port, 2, is_master=rank == 0, timeout=timedelta(seconds=_TIMEOUT_S)
        )
        self._barriers = 0
        self._captures = 0
        self.aux = new_process_group(
            self.backend, dist.PrefixStore("bench/aux", self.store), rank, 2, _TIMEOUT_S
        )
        self.ep = new_process_group(
            self.backend, dist.PrefixStore("bench/ep", self.store), rank, 2, _TIMEOUT_S
        )
        self._open_channel()
        self.results: dict = {"sections_failed": {}}

    def _open_channel(self) -> None:
        if self.rank == 1:
            self.ffn_channel = FFNChannel("127.0.0.1", self.backend, _TIMEOUT_S, ubatch_groups=2)
            address = self.ffn_channel.address
            self.store.set(
                "ffn_address", json.dumps([address.host, address.store_port, address.control_port])
            )
            join = self.ffn_channel.recv_header(_TIMEOUT_S)
            if join is None or join.kind is not HeaderKind.JOIN:
                raise RuntimeError(f"expected a JOIN header, got {join}")
            self.ffn_channel.admit(join.peer)
        else:
            host, store_port, control_port = json.loads(self.store.get("ffn_address"))
            address = FFNAddress(host, store_port, control_port)
            self.channel = AttentionChannel(address, 0, 0, self.backend, _TIMEOUT_S, ubatch_groups=2)

    def barrier(self) -> None:
        """Both ranks reach this point (TCPStore counter; no device work)."""
        self._barriers += 1
        key = f"barrier/{self._barriers}"
        self.store.add(key, 1)
        while int(self.store.add(key, 0)) < 2:
            time.sleep(0.001)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def share(self, key: str, value: object | None = None) -> object:
        """Rank 1 publishes `value` under `key`; rank 0 returns it."""
        if self.rank == 1:
            self.store.set(f"share/{key}", json.dumps(value))
            return value
        return json.loads(self.store.get(f"share/{key}"))

    def capture(self, fn: Callable[[], None], paired: bool = False) -> Callable[[], None]:
        """`fn` as one CUDA graph replay (after one eager call has run), or `fn` on CPU.

        If the capture fails, `fn` runs eagerly instead and the error is recorded under
        `graph_failures`. `paired`: `fn` talks to the other rank, which captures its
        side at the same point; both then fall back together if either failed.
        """
        if not self.cuda:
            return fn
        self.sync()
        graph = torch.cuda.CUDAGraph()
        error = ""
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                fn()
            self.sync()
        except RuntimeError as exc:  # CUDA/NCCL errors: fall back to eager, recorded
            traceback.print_exc()
            error = repr(exc)[:500]
        errors = [error]
        if paired:
            self._captures += 1
            self.store.set(f"capture/{self._captures}/{self.rank}", error)
            errors.append(self.store.get(f"capture/{self._captures}/{1 - self.rank}").decode())
        if any(errors):
            self.results.setdefault("graph_failures", []).append({"paired": paired, "errors": errors})
            self._log(f"graph capture failed, eager instead: {errors}")
            return fn
        return graph.replay

    def time_steps(self, step: Callable[[], None], iters: int) -> dict[str, float]:
        """Median per-step times of `iters` steps: `gpu_ms` (events, host ahead; wall on
        CPU) and `step_ms` (wall with a synchronization after each step)."""
        gpu = []
        if self.cuda:
            events = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(iters)
            ]
            for start, end in events:
                start.record()
                step()
                end.record()
            self.sync()
            gpu = [start.elapsed_time(end) for start, end in events]
        wall = []
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            self.sync()
            wall.append((time.perf_counter() - t0) * 1e3)
        step_ms = statistics.median(wall)
        return {"gpu_ms": statistics.median(gpu) if gpu else step_ms, "step_ms": step_ms}

    def steps_per_timing(self) -> int:
        """Steps one `time_steps` call runs (the FFN rank serves as many headers)."""
        return (2 if self.cuda else 1) * self.args.iters

    def serve(self, serve_step: Callable[[], None], steps: int, num_tokens: int) -> None:
        """FFN rank: for each of `steps` step headers (which must announce `num_tokens`),
        run `serve_step` (the header itself stays outside any graph)."""
        for _ in range(steps):
            header = self.ffn_channel.recv_header(_TIMEOUT_S)
            if header is None or header.kind is not HeaderKind.STEP or header.num_tokens != num_tokens:
                raise RuntimeError(f"FFN rank expected STEP({num_tokens}), got {header}")
            serve_step()

    def afd_attention(self, step: Callable[[], None], num_tokens: int) -> Callable[[], None]:
        """Attention rank: a step = its header, then `step` (eager or a graph replay)."""

        def run() -> None:
            self.channel.send_header(num_tokens)
            step()

        return run

    def write(self) -> None:
        if self.rank == 0:
            Path(self.args.out).write_text(json.dumps(self.results, indent=2))

    def section(self, name: str, fn: Callable[[], None]) -> None:
        """Run one section on both ranks; record a failure and go on; write the JSON."""
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # record it in the JSON; the parent then stops the other rank
            traceback.print_exc()
            self.results["sections_failed"][f"{name}/rank{self.rank}"] = repr(exc)[:2000]
            raise
        finally:
            self._log(f"section {name}: {time.perf_counter() - t0:.1f} s")
            self.write()

    def _log(self, msg: str) -> None:
        print(f"[rank {self.rank}] {msg}", flush=True)
