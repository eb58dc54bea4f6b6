"""Connector microbenchmarks of the GPU decode benchmark (`afd_ray.bench.decode`), on the
pair of `decode_pair.PairRank`:

1. `p2p`: NCCL point-to-point bulk bandwidth on a bare pair group (1 GiB), and bulk
   A2F through the connector (`[65536, H]` bf16), as a share of it.
2. `roundtrip`: A2F + F2A per layer for `T` rows, `[T, H]` bf16, over L layers of a
   step (FFN side sends back what it received), eager and in one CUDA graph per side
   and step; µs per layer = median step time on the attention rank / L.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from afd_ray.bench.decode_pair import PairRank
from afd_ray.connector.buffers import RecvBuffers
from afd_ray.connector.ubatch import attention_layers, ffn_layers

__all__ = ["ConnectorSections"]


class ConnectorSections(PairRank):
    """The `p2p` and `roundtrip` sections (results under the keys of the module docstring)."""

    # -- 1. P2P bulk ---------------------------------------------------------------------------------------
    def p2p(self) -> None:
        iters = 10 if self.cuda else 2
        nbytes = (1 << 30) if self.cuda else (1 << 20)
        raw = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=self.device)
        rows = nbytes // 2 // self.args.hidden_a2f
        hidden = torch.randn(rows, self.args.hidden_a2f, dtype=self.dtype, device=self.device)
        ack = torch.ones(1, device=self.device)

        def one_way(send: Callable[[], None], recv: Callable[[], None]) -> float:
            for _ in range(2):  # warm-up, then timed
                self.barrier()
                self.sync()
                t0 = time.perf_counter()
                for _ in range(iters):
                    (send if self.rank == 0 else recv)()
                if self.rank == 0:
                    self.aux.recv([ack], 1, 9).wait()
                else:
                    self.aux.send([ack], 0, 9).wait()
                self.sync()
                elapsed = time.perf_counter() - t0
            return elapsed

        raw_s = one_way(lambda: self.aux.send([raw], 1, 7).wait(), lambda: self.aux.recv([raw], 0, 7).wait())
        a2f_bytes = hidden.numel() * hidden.element_size()
        a2f_s = one_way(
            lambda: self.channel.isend_a2f(hidden).wait(),
            lambda: self.ffn_channel.irecv_a2f(0, hidden).wait(),
        )
        if self.rank == 0:
            raw_gbps = iters * nbytes / raw_s / 1e9
            a2f_gbps = iters * a2f_bytes / a2f_s / 1e9
            self.results["p2p"] = {
                "p2p_bulk_GBps": raw_gbps,
                "p2p_bulk_bytes": nbytes,
                "a2f_bulk_GBps": a2f_gbps,
                "a2f_bulk_shape": list(hidden.shape),
                "iters": iters,
            }
            # The A2F path is the same NCCL send; a ratio above 1 is timing noise.
            self.results["p2p"]["a2f_over_p2p_raw"] = a2f_gbps / raw_gbps
            self.results["bulk_share_of_p2p"] = min(1.0, a2f_gbps / raw_gbps)
            self._log(f"P2P {raw_gbps:.1f} GB/s, bulk A2F {a2f_gbps:.1f} GB/s ({a2f_gbps / raw_gbps:.1%})")

    # -- 2. connector round trip ---------------------------------------------------------------------------
    def roundtrip(self) -> None:
        layers, hidden_size = self.args.roundtrip_layers, self.args.hidden_a2f
        buffers = RecvBuffers(self.args.roundtrip_tokens, hidden_size, self.dtype, self.device)
        eager_us: dict[str, float] = {}
        graph_us: dict[str, float] = {}
        for tokens in self.args.roundtrip_tokens:
            recv = [buffers.get(tokens)]
            if self.rank == 0:
                x = torch.randn(tokens, hidden_size, dtype=self.dtype, device=self.device)

                def step(x: torch.Tensor = x, recv: list[torch.Tensor] = recv) -> None:
                    attention_layers(
                        layers, lambda layer, u: x, lambda layer, u, out: None, recv, self.channel
                    )
            else:

                def step(recv: list[torch.Tensor] = recv) -> None:
                    ffn_layers(layers, lambda layer, hidden: hidden, recv, self.ffn_channel, 0)

            for mode, out in (
                (("eager", eager_us), ("graph", graph_us)) if self.cuda else (("eager", eager_us),)
            ):
                self.barrier()
                failures = len(self.results.get("graph_failures", []))
                if self.rank == 0:
                    self.afd_attention(step, tokens)()  # warm-up
                    run = self.afd_attention(self.capture(step, True) if mode == "graph" else step, tokens)
                    for _ in range(self.args.warmup):
                        run()
                    self.sync()
                    times = self.time_steps(run, self.args.iters)
                    if len(self.results.get("graph_failures", [])) == failures:
                        out[str(tokens)] = times["gpu_ms"] * 1e3 / layers
                        self._log(f"round trip T={tokens} {mode}: {out[str(tokens)]:.1f} us/layer")
                else:
                    self.serve(step, 1, tokens)
                    run = self.capture(step, True) if mode == "graph" else step
                    self.serve(run, self.args.warmup + self.steps_per_timing(), tokens)
                self.sync()
        if self.rank == 0:
            self.results["roundtrip_us_eager"] = eager_us
            self.results["roundtrip_us_graph"] = graph_us or None
            self.results["roundtrip"] = {
                "layers": layers,
                "hidden_size": hidden_size,
                "dtype": str(self.dtype),
            }
