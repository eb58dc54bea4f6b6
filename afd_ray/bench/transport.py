"""Transport microbenchmark: A2F + F2A round trip per layer through the connector
contract, for every CPU transport, two processes on this host.

`python -m afd_ray.bench.transport [--out PATH]`. The attention process (this one)
opens an `AttentionChannel` per transport to a spawned loopback FFN
(`afd_ray.connector.loopback`) that answers each layer with its input (no compute: the
FFN copies the A2F rows out of the transport into a `[T, H]` buffer and sends that
buffer back). A step is one
STEP header and `layers` exchanges, as in serving; the figure is the median over
steps of (step time / layers), in microseconds. Before timing, one step checks that
every layer's answer equals what was sent (bit for bit).

Run with nothing else busy on the machine's cores for the figures to mean transport
cost; the JSON records the core count and the load average at the start.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from functools import partial
from pathlib import Path

import torch
import torch.multiprocessing as mp

from afd_ray.connector.channel import AttentionChannel
from afd_ray.connector.header import FFNAddress
from afd_ray.connector.loopback import Answer, serve_loopback_ffn
from afd_ray.connector.transports import Transport

__all__ = ["measure", "run"]

CPU_TRANSPORTS: tuple[Transport, ...] = ("shm", "gloo")
_TIMEOUT_S = 60.0


def _mlp(hidden_size: int, intermediate: int = 1536) -> Answer:
    """The loopback FFN's answer with `compute`: a gated MLP of SmolLM2-135M's size
    (H=576, I=1536), random float32 weights, `[T, H] -> [T, H]` for every layer."""
    gate_up = torch.randn(2 * intermediate, hidden_size) / hidden_size**0.5
    down = torch.randn(hidden_size, intermediate) / intermediate**0.5

    def mlp(layer: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = (x @ gate_up.T).chunk(2, dim=-1)  # [T, I] each
        return (torch.nn.functional.silu(gate) * up) @ down.T  # [T, H]

    return mlp


def measure(
    address: FFNAddress,
    transport: Transport,
    peer: int,
    tokens: int,
    hidden_size: int,
    layers: int,
    steps: int,
    compute: bool = False,
) -> tuple[float, float]:
    """Median wall time per layer (µs) of `steps` steps of `layers` exchanges of
    `[tokens, hidden_size]` float32, after a warm-up step; without `compute` the
    warm-up checks that every answer equals what was sent. With `compute`, each
    layer also runs an attention stand-in here (`[T, H] @ [H, 1536]`, about
    SmolLM2's attention projections) and the FFN process a SmolLM2-sized MLP.
    Second: this process's CPU time per layer (µs; Python, copies and syscalls of
    the attention side; the rest of the wall time is waiting for the FFN side).

    Raises:
        AssertionError: an answer differs from what was sent.
    """
    link = AttentionChannel(address, peer, 0, transport, _TIMEOUT_S)
    try:
        hidden = torch.randn(tokens, hidden_size)
        out = torch.empty_like(hidden)
        link.send_header(tokens)
        for layer in range(layers):
            sent = hidden * (layer + 1)
            if not torch.equal(link.exchange(sent, out=out), sent) and not compute:
                raise AssertionError(f"{transport}: layer {layer} came back changed (T={tokens})")
        attend = torch.randn(hidden_size, 1536) / hidden_size**0.5
        per_layer, cpu_per_layer = [], []
        for _ in range(steps):
            start, cpu = time.perf_counter(), time.process_time()
            link.send_header(tokens)
            for _ in range(layers):
                if compute:
                    hidden = torch.tanh(hidden @ attend)[:, :hidden_size].contiguous()  # [T, H]
                link.exchange(hidden, out=out)
            per_layer.append((time.perf_counter() - start) / layers * 1e6)
            cpu_per_layer.append((time.process_time() - cpu) / layers * 1e6)
        return statistics.median(per_layer), statistics.median(cpu_per_layer)
    finally:
        link.close()


def run(
    transports: tuple[Transport, ...] = CPU_TRANSPORTS,
    token_counts: tuple[int, ...] = (1, 16, 128),
    hidden_size: int = 576,
    layers: int = 30,
    steps: int = 50,
    threads: int = 1,
    compute: bool = False,
) -> dict[str, object]:
    """Round trip per layer (µs) for each transport and token count; `hidden_size`
    and `layers` default to SmolLM2-135M's (H = 576, 30 layers). `threads`: torch
    threads of each side; `compute`: time whole layers with compute on both sides
    (see `measure`), to compare one thread each against all cores each."""
    torch.set_num_threads(threads)
    context = mp.get_context("spawn")
    queue = context.Queue()
    ffn = context.Process(
        target=serve_loopback_ffn,
        args=(queue, "gloo", hidden_size, layers, _TIMEOUT_S),
        kwargs={"make_answer": partial(_mlp, hidden_size) if compute else None, "threads": threads},
        daemon=True,
    )
    ffn.start()
    try:
        address = queue.get(timeout=_TIMEOUT_S)
        results: dict[str, dict[str, float]] = {}
        cpu: dict[str, dict[str, float]] = {}
        peer = 0
        for transport in transports:
            results[transport], cpu[transport] = {}, {}
            for tokens in token_counts:
                results[transport][str(tokens)], cpu[transport][str(tokens)] = measure(
                    address, transport, peer, tokens, hidden_size, layers, steps, compute
                )
                peer += 1
    finally:
        ffn.terminate()
        ffn.join(10)
    return {
        "roundtrip_us_per_layer": results,
        "attention_cpu_us_per_layer": cpu,
        "hidden_size": hidden_size,
        "dtype": "float32",
        "layers_per_step": layers,
        "steps": steps,
        "threads_per_side": threads,
        "compute": compute,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load_average_at_start": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m afd_ray.bench.transport", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the result JSON here")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each side")
    parser.add_argument("--compute", action="store_true", help="SmolLM2-sized compute on both sides per layer")
    args = parser.parse_args()
    result = run(steps=args.steps, threads=args.threads, compute=args.compute)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result))


def format_table(result: dict[str, object]) -> str:
    """`transport | T=1 | T=16 | T=128` in µs per layer."""
    table = result["roundtrip_us_per_layer"]
    counts = list(next(iter(table.values())))
    lines = ["| transport | " + " | ".join(f"T={t}" for t in counts) + " |", "|---" * (len(counts) + 1) + "|"]
    for transport, row in table.items():
        cpu = result["attention_cpu_us_per_layer"][transport]
        lines.append(f"| {transport} | " + " | ".join(f"{row[t]:.0f} ({cpu[t]:.0f})" for t in counts) + " |")
    return "\n".join(lines) + (
        f"\n(per layer, µs, H={result['hidden_size']} float32: wall (attention-side CPU); "
        f"compute={result['compute']}, {result['threads_per_side']} thread(s) per side)"
    )


if __name__ == "__main__":
    main()
