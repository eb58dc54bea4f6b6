"""FFN compute per layer, and CUDA graphs of it (or of any step) per token-count bucket.

A CUDA graph replays fixed kernels on fixed addresses, so the work is captured once
per row count (bucket) over static buffers: a step of T tokens writes its rows into
the first T rows of the buffers, pads to the smallest bucket >= T and replays that
bucket's graph; a step larger than every bucket runs eagerly on its own tensors.
Padding rows hold finite leftovers of earlier steps (zeros at first) and their
outputs are dropped.

- `ffn_layer`: one FFN block on `[N, H]` rows (with EP, the static-shape
  `EPGroup.moe`); no host synchronization on CUDA, so it can be captured.
- `BucketGraphs`: captures any callable `fn(rows)` per bucket and replays it; `fn`
  may include torch process-group collectives and P2P send/recv (NCCL), e.g. a whole
  FFN step with its A2F receives and F2A sends per layer.
- `FFNGraphs`: `ffn_layer` of every layer over static input buffers, one
  `BucketGraphs` per layer, sharing one memory pool (compute only; the A2F/F2A
  transfers stay outside). This is what `FFNRuntime` runs.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from functools import partial
from typing import Generic, NamedTuple, TypeVar

import torch

from afd_ray.ffn.ep import EPGroup
from afd_ray.ffn.model import FFNStack
from afd_ray.layers.moe import MoE
from afd_ray.layers.routing import Routing
from afd_ray.devices import pooled_stream_other_than

__all__ = [
    "DEFAULT_BUCKETS",
    "BucketGraphs",
    "FFNGraphs",
    "LayerOutput",
    "StepInputs",
    "bucket_of",
    "ffn_layer",
    "graphs_supported",
]

DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
"""Token counts (per FFN rank) captured by default: decode-sized steps."""

Out = TypeVar("Out")


class LayerOutput(NamedTuple):
    """What one FFN block returns for `[N, H]` rows."""

    out: torch.Tensor
    """`[N, H]` model dtype (`[N, P, H]`: an MoE layer's split output, `MoE.output`)."""
    ids: torch.Tensor | None
    """`[N, k]` int64 routed experts of each row (MoE layer; for the expert load), or
    None (dense layer)."""


def ffn_layer(
    model: FFNStack, ep: EPGroup | None, layer: int, hidden: torch.Tensor, routing: Routing | None
) -> LayerOutput:
    """The FFN block `model.layers[layer]` on `hidden` `[N, H]` (model dtype).

    An MoE layer routes `hidden` itself unless `routing` (ids `[N, k]` int64, weights
    `[N, k]` float32; `gate_on_attention`) is given. With `ep`, every EP rank must
    call this for the same layer with the same N (`EPGroup.moe`). Runs no host
    synchronization on CUDA (bfloat16 experts, see `Experts.forward`), so it may be
    captured in a CUDA graph.
    """
    block = model.layers[layer]
    if not isinstance(block, MoE):
        return LayerOutput(block(hidden), None)
    if ep is None:
        out, routing = block.forward_routed(hidden, routing)
        return LayerOutput(out, routing.ids)
    routing = block.route(hidden) if routing is None else routing
    return LayerOutput(ep.moe(block, hidden, routing), routing.ids)


def bucket_of(buckets: Sequence[int], rows: int) -> int | None:
    """The smallest of the increasing `buckets` that holds `rows`, or None if none does."""
    i = bisect.bisect_left(buckets, rows)
    return buckets[i] if i < len(buckets) else None


def graphs_supported(model: FFNStack, dtype: torch.dtype) -> bool:
    """Whether `model`'s layers can be captured: on CUDA, and for MoE layers bfloat16
    on SM 9.x/10.x (elsewhere torch's grouped_mm synchronizes with the host)."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return False
    if not model.moe_blocks:
        return True
    return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] in (9, 10)


def _check_buckets(buckets: Sequence[int]) -> tuple[int, ...]:
    if any(b < 1 for b in buckets) or any(a >= b for a, b in itertools.pairwise(buckets)):
        raise ValueError(f"graph buckets must be positive and strictly increasing, got {list(buckets)}")
    return tuple(buckets)


class BucketGraphs(Generic[Out]):
    """A callable `fn(rows)` captured as one CUDA graph per bucket, replayed on call.

    `fn(rows)` must read and write only tensors that outlive it at fixed addresses
    (typically views `[:rows]` of buffers allocated once for the largest bucket), and
    run no host synchronization; what it returns (tensors, or tuples of them, allocated
    during capture in the graphs' pool) is returned again by every replay of that
    bucket, overwritten in place. Capture runs `fn` eagerly `warmup` times per bucket
    first (lazy initialization: cuBLAS workspaces, NCCL communicators), largest
    bucket first, on one side stream.

    Collectives and P2P send/recv of torch process groups (NCCL) may run inside `fn`:
    then every rank of those groups must build its `BucketGraphs` at the same time
    with the same buckets (the warm-up runs communicate), and replay the same buckets
    in the same order as its peers. A graph holds the communicator it captured:
    rebuild after a group changes.

    Graphs that share a `pool` (`torch.cuda.graph_pool_handle()`) reuse each other's
    temporaries, so they must never replay concurrently; give concurrent work (e.g.
    two micro-batches on two streams) separate pools.

    Args:
        fn: the work for `rows` rows.
        buckets: row counts to capture, strictly increasing; empty: `fn` always runs
            eagerly (any device).
        pool: memory pool to capture into; None: a new one.
        warmup: eager runs of `fn` per bucket before its capture.

    Raises:
        ValueError: bad buckets, or buckets given without CUDA.
    """

    def __init__(
        self,
        fn: Callable[[int], Out],
        buckets: Sequence[int],
        pool: tuple[int, int] | None = None,
        warmup: int = 1,
    ) -> None:
        self.buckets = _check_buckets(buckets)
        self._fn = fn
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, Out] = {}
        if not self.buckets:
            return
        if not torch.cuda.is_available():
            raise ValueError("CUDA graph buckets need a CUDA device; pass no buckets to run eagerly")
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        current = torch.cuda.current_stream()
        stream = pooled_stream_other_than(current.device, current.cuda_stream)  # capture beside, not on, the caller's
        stream.wait_stream(current)
        for rows in reversed(self.buckets):
            with torch.cuda.stream(stream):
                for _ in range(warmup):
                    fn(rows)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                self._outputs[rows] = fn(rows)
            self._graphs[rows] = graph
        current.wait_stream(stream)

    def __call__(self, rows: int) -> Out:
        """`fn(rows)`: the graph of bucket `rows` replayed on the current stream, or
        `fn` run eagerly if `rows` is not a captured bucket."""
        graph = self._graphs.get(rows)
        if graph is None:
            return self._fn(rows)
        graph.replay()
        return self._outputs[rows]


class StepInputs(NamedTuple):
    """Where one step's layers read their rows (R = padded rows): write the step's T
    rows into `[:T]` before each layer's `FFNGraphs.run`."""

    hidden: torch.Tensor
    """`[R, H]` model dtype."""
    routing: Routing | None
    """ids `[R, k]` int64 and weights `[R, k]` float32 with `gate_on_attention`, else None."""
    bucket: int | None
    """The captured bucket R these buffers belong to, or None: eager, own tensors."""


def _on_buffers(model: FFNStack, ep: EPGroup | None, static: StepInputs, layer: int, rows: int) -> LayerOutput:
    """`ffn_layer` on the first `rows` rows of the static buffers (what a graph captures;
    no reference to the `FFNGraphs`, so dropping it frees its graphs at once)."""
    routing = None if static.routing is None else Routing(static.routing.ids[:rows], static.routing.weights[:rows])
    return ffn_layer(model, ep, layer, static.hidden[:rows], routing)


class FFNGraphs:
    """Every FFN layer of `model` over static input buffers, as CUDA graphs per bucket.

    Buffers (allocated once, zeros; R = the largest bucket): hidden `[R, H]` model
    dtype, and with `gate_on_attention` the routing ids `[R, k]` int64 and weights
    `[R, k]` float32. Layer l's graph of bucket b reads `[:b]` of them and returns a
    `LayerOutput` of `[b, ...]` tensors in the graphs' pool (one per layer and bucket,
    valid until that graph replays again).

    Building captures every layer for every bucket (see `BucketGraphs`; with `ep`
    every EP rank must build at the same time, with the same buckets). Replays run on
    the current stream, one at a time.

    Args:
        model: the FFN stack, on its device (CUDA for buckets).
        ep: the EP group, or None.
        dtype: model dtype of the rows.
        buckets: padded row counts to capture, strictly increasing (`DEFAULT_BUCKETS`);
            empty: every step runs eagerly on tensors of its own (CPU).

    Raises:
        ValueError: bad buckets, or buckets without CUDA.
    """

    def __init__(
        self, model: FFNStack, ep: EPGroup | None, dtype: torch.dtype, buckets: Sequence[int] = DEFAULT_BUCKETS
    ) -> None:
        self.model = model
        self.ep = ep
        self.buckets = _check_buckets(buckets)
        self._dtype = dtype
        self._device = next(model.parameters()).device
        moe = model.moe_blocks
        self._top_k = moe[0].spec.top_k if moe else 0
        with torch.inference_mode():
            self._static = self._zeros(self.buckets[-1] if self.buckets else 0)
            pool = torch.cuda.graph_pool_handle() if self.buckets else None
            self._graphs = [
                BucketGraphs(partial(_on_buffers, model, ep, self._static, layer), self.buckets, pool)
                for layer in range(model.num_layers)
            ]

    def _zeros(self, rows: int) -> StepInputs:
        hidden = torch.zeros(rows, self.model.hidden_size, dtype=self._dtype, device=self._device)
        routing = None
        if self.model.gate_on_attention:
            ids = torch.zeros(rows, self._top_k, dtype=torch.int64, device=self._device)
            routing = Routing(ids, torch.zeros(rows, self._top_k, dtype=torch.float32, device=self._device))
        return StepInputs(hidden, routing, None)

    def inputs(self, rows: int) -> StepInputs:
        """Buffers for a step of `rows` rows per EP rank (with EP: the largest local
        token count, the same on every rank): the static buffers padded to the
        smallest bucket that holds `rows`, else new zero tensors of exactly `rows`."""
        bucket = bucket_of(self.buckets, rows)
        if bucket is None:
            return self._zeros(rows)
        hidden, routing, _ = self._static
        routing = None if routing is None else Routing(routing.ids[:bucket], routing.weights[:bucket])
        return StepInputs(hidden[:bucket], routing, bucket)

    def run(self, layer: int, inputs: StepInputs) -> LayerOutput:
        """FFN layer `layer` on `inputs` (from `inputs()`): the bucket's graph replayed,
        or `ffn_layer` eagerly. Returns `[R, ...]`; rows past the step's own are padding."""
        if inputs.bucket is None:
            return ffn_layer(self.model, self.ep, layer, inputs.hidden, inputs.routing)
        return self._graphs[layer](inputs.bucket)
