"""Transport microbenchmark: A2F + F2A round trip per layer through the connector
contract, for every CPU transport, two processes on this host.

`python -m afd_ray.bench.transport [--out PATH]`. The attention process (this one)
opens an `AttentionChannel` per transport to an FFN process (`FFNChannel`, spawned)
that answers each layer with its input (no compute: the FFN copies the A2F rows out
of the transport into a `[T, H]` buffer and sends that buffer back). A step is one
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
from pathlib import Path

import torch
import torch.multiprocessing as mp

from afd_ray.connector.channel import AttentionChannel, FFNAddress, FFNChannel
from afd_ray.connector.header import HeaderKind
from afd_ray.connector.link import Transport

__all__ = ["measure", "run"]

CPU_TRANSPORTS: tuple[Transport, ...] = ("shm", "gloo")
_TIMEOUT_S = 60.0


def _ffn(queue: mp.Queue, hidden_size: int, layers: int, threads: int) -> None:
    """FFN process: admit each peer, echo every layer of every step, until idle."""
    torch.set_num_threads(threads)
    channel = FFNChannel("127.0.0.1", "gloo", _TIMEOUT_S)
    queue.put(channel.address)
    buffers: dict[int, torch.Tensor] = {}
    while (header := channel.recv_header(_TIMEOUT_S)) is not None:
        if header.kind is HeaderKind.JOIN:
            channel.admit(header.peer)
        elif header.kind is HeaderKind.LEAVE:
            channel.remove(header.peer)
        else:
            rows = buffers.setdefault(header.num_tokens, torch.empty(header.num_tokens, hidden_size))
            for _ in range(layers):
                channel.send_f2a(header.peer, channel.recv_a2f(header.peer, rows))
    channel.close()


def measure(
    address: FFNAddress, transport: Transport, peer: int, tokens: int, hidden_size: int, layers: int, steps: int
) -> float:
    """Median round trip per layer (µs) of `steps` steps of `layers` exchanges of
    `[tokens, hidden_size]` float32, after a checked warm-up step.

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
            if not torch.equal(link.exchange(sent, out=out), sent):
                raise AssertionError(f"{transport}: layer {layer} came back changed (T={tokens})")
        per_layer = []
        for _ in range(steps):
            start = time.perf_counter()
            link.send_header(tokens)
            for _ in range(layers):
                link.exchange(hidden, out=out)
            per_layer.append((time.perf_counter() - start) / layers * 1e6)
        return statistics.median(per_layer)
    finally:
        link.close()


def run(
    transports: tuple[Transport, ...] = CPU_TRANSPORTS,
    token_counts: tuple[int, ...] = (1, 16, 128),
    hidden_size: int = 576,
    layers: int = 30,
    steps: int = 50,
    threads: int = 1,
) -> dict[str, object]:
    """Round trip per layer (µs) for each transport and token count; `hidden_size`
    and `layers` default to SmolLM2-135M's (H = 576, 30 layers)."""
    torch.set_num_threads(threads)
    context = mp.get_context("spawn")
    queue = context.Queue()
    ffn = context.Process(target=_ffn, args=(queue, hidden_size, layers, threads), daemon=True)
    ffn.start()
    try:
        address = queue.get(timeout=_TIMEOUT_S)
        results: dict[str, dict[str, float]] = {}
        peer = 0
        for transport in transports:
            results[transport] = {}
            for tokens in token_counts:
                results[transport][str(tokens)] = measure(
                    address, transport, peer, tokens, hidden_size, layers, steps
                )
                peer += 1
    finally:
        ffn.terminate()
        ffn.join(10)
    return {
        "roundtrip_us_per_layer": results,
        "hidden_size": hidden_size,
        "dtype": "float32",
        "layers_per_step": layers,
        "steps": steps,
        "threads_per_side": threads,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load_average_at_start": os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m afd_ray.bench.transport", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the result JSON here")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    result = run(steps=args.steps)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result))


def format_table(result: dict[str, object]) -> str:
    """`transport | T=1 | T=16 | T=128` in µs per layer."""
    table = result["roundtrip_us_per_layer"]
    counts = list(next(iter(table.values())))
    lines = ["| transport | " + " | ".join(f"T={t}" for t in counts) + " |", "|---" * (len(counts) + 1) + "|"]
    for transport, row in table.items():
        lines.append(f"| {transport} | " + " | ".join(f"{row[t]:.0f}" for t in counts) + " |")
    return "\n".join(lines) + f"\n(A2F+F2A round trip per layer, µs, H={result['hidden_size']} float32)"


if __name__ == "__main__":
    main()
