"""One MoE layer's FFN, split into the parts an EP runtime drives: route, experts, shared."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from afd_ray.devices import pooled_stream_other_than
from afd_ray.layers.experts import ExpertSlots, Experts
from afd_ray.layers.fp8 import Fp8Experts
from afd_ray.layers.fused import fused_experts_applies, fused_moe
from afd_ray.layers.mlp import GatedMLP
from afd_ray.layers.routing import Router, Routing
from afd_ray.layers.spec import MoEShape

__all__ = ["MoE"]


class MoE(nn.Module):
    """Gate, the routed expert slots this EP rank holds (`ExpertSlots`), and the shared
    experts (replicated).

    An EP step on hidden `[T, H]`: `route` (any rank, the gate is replicated) ->
    dispatch rows to the owners of `routing.ids` -> `experts` on each owner -> return
    the rows -> sum the k rows of each token -> add `shared(hidden)`. `forward` is that
    step on one rank that owns every expert.

    Submodule names match the checkpoint's FFN block names
    (`afd_ray.weights.ffn_block_name`): `gate`, `experts`, `shared_experts`.
    `act_in_float32`: the shared experts' activation rounding (`GatedMLP`).
    `split_output` (`MoEShape.split_output`): the output is the parts `[T, P, H]`
    (routed experts with unscaled routing weights, then shared experts), each in the
    model dtype, instead of their sum `[T, H]`.
    """

    def __init__(
        self,
        shape: MoEShape,
        slots: ExpertSlots,
        hidden_size: int,
        hidden_act: str,
        bias: bool,
        dtype: torch.dtype,
        with_gate: bool = True,
        act_in_float32: bool = False,
        split_output: bool = False,
    ) -> None:
        super().__init__()
        self.spec = shape.routing
        self.hidden_act = hidden_act
        self.split_output = split_output
        # gate_on_attention: the attention role routes and sends ids and weights.
        self.gate = Router(shape.routing_of(split_output), hidden_size, dtype) if with_gate else None
        self.experts = Experts(slots, hidden_size, shape.intermediate_size, hidden_act, dtype)
        self.shared_experts = (
            GatedMLP(hidden_size, shape.shared_intermediate_size, hidden_act, bias, dtype, act_in_float32)
            if shape.shared_intermediate_size
            else None
        )

    def route(self, hidden: torch.Tensor) -> Routing:
        """Top-k experts of hidden `[T, H]`: ids `[T, k]` int64, weights `[T, k]` float32.

        Raises:
            RuntimeError: built without a gate (`gate_on_attention`).
        """
        if self.gate is None:
            raise RuntimeError("this MoE has no gate: with gate_on_attention the routing comes with the rows")
        return self.gate(hidden)

    def shared(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Shared experts' output `[T, H]` (model dtype), or None if the layer has none."""
        return None if self.shared_experts is None else self.shared_experts(hidden)

    def begin_shared(self, hidden: torch.Tensor) -> Callable[[], torch.Tensor | None]:
        """Start the shared experts on hidden `[T, H]`; the returned call gives their
        output `[T, H]` (model dtype), or None if the layer has none.

        On CUDA they run on a side stream, overlapping what the caller queues next on
        the current stream (routing, the routed experts), as vLLM's `SharedFusedMoE`
        overlaps them: the call makes the current stream wait for them. This captures
        in a CUDA graph (the side stream forks from and joins the capturing stream).
        Elsewhere they are computed at once.
        """
        if self.shared_experts is None or not hidden.is_cuda:
            shared = self.shared(hidden)
            return lambda: shared
        current = torch.cuda.current_stream(hidden.device)
        side = _side_stream(hidden.device, current.cuda_stream)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            shared = self.shared_experts(hidden)

        def join() -> torch.Tensor:
            current.wait_stream(side)
            return shared

        return join

    def forward(self, hidden: torch.Tensor, routing: Routing | None = None) -> torch.Tensor:
        """The whole MoE on one rank: hidden `[T, H]` -> `[T, H]` (`[T, P, H]` with
        `split_output`), same dtype (`forward_routed` without its routing)."""
        return self.forward_routed(hidden, routing)[0]

    def forward_routed(self, hidden: torch.Tensor, routing: Routing | None = None) -> tuple[torch.Tensor, Routing]:
        """The whole MoE on one rank and the routing it used: hidden `[T, H]` ->
        (`[T, H]` (`[T, P, H]` with `split_output`) same dtype, `Routing`).

        `routing` is `route(hidden)` when the caller already computed it. The shared
        experts start first (`begin_shared`: on CUDA a side stream, overlapping the
        routing and the routed experts). On CUDA the routed experts run as vLLM's
        fused MoE kernels (`routed_fused`, the kernels plain vLLM runs); elsewhere as
        torch grouped GEMMs (`routed_grouped`). Then `output`.

        Raises:
            RuntimeError: this module holds only an EP shard of the experts.
        """
        num_experts = self.spec.num_experts
        if self.experts.owned != tuple(range(num_experts)):
            raise RuntimeError(f"MoE.forward needs all {num_experts} experts; this EP shard holds {self.experts.owned}")
        shared = self.begin_shared(hidden)
        routing = self.route(hidden) if routing is None else routing
        if fused_experts_applies(hidden, self.hidden_act):
            routed = self.routed_fused(hidden, routing)  # [T, H] model dtype
        else:
            routed = self.routed_grouped(hidden, routing)  # [T, H] float32
        return self.output(routed, shared(), hidden.dtype), routing

    def output(self, routed: torch.Tensor, shared: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """The layer's output from the routed experts' `[T, H]` (float32 or `dtype`)
        and the shared experts' `[T, H]` (`dtype`, or None).

        Returns `[T, H]` `dtype`: the sum taken in float32, cast once; with
        `split_output`, `[T, P, H]` `dtype`: the parts (`MoEShape.output_parts`).
        """
        if self.split_output:
            parts = [routed.to(dtype)] if shared is None else [routed.to(dtype), shared]
            return torch.stack(parts, dim=1)  # [T, P, H]
        if shared is None:
            return routed.to(dtype)
        if routed.dtype == dtype:
            # torch adds float16/bfloat16 tensors in float32 and rounds once: one kernel
            return routed + shared
        return (routed.float() + shared).to(dtype)

    def routed_fused(self, hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Routed experts of hidden `[T, H]` (CUDA) with vLLM's `fused_experts`: `[T, H]`
        in the model dtype (the kernel sums a token's k rows in that dtype); its FP8
        kernels when the experts are FP8 (`afd_ray.layers.fp8`, `model.quantization`).

        Raises:
            NotImplementedError: vLLM's fused MoE kernels are not available.
        """
        experts = self.experts
        if isinstance(experts, Fp8Experts):
            return experts.fused(hidden, routing.ids, routing.weights)
        return fused_moe(hidden, experts.gate_up, experts.down, routing.ids, routing.weights, self.hidden_act)

    def routed_grouped(self, hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Routed experts of hidden `[T, H]` with torch grouped GEMMs (`Experts.forward`):
        `[T, H]` float32, the k weighted rows of a token summed in float32."""
        num_tokens, hidden_size = hidden.shape
        top_k = routing.ids.shape[1]
        # [T*k, H]; row t*k+j is token t's j-th expert
        rows = hidden.unsqueeze(1).expand(-1, top_k, -1).reshape(-1, hidden_size)
        out = self.experts(rows, routing.ids.flatten(), routing.weights.flatten())  # [T*k, H]
        return out.view(num_tokens, top_k, hidden_size).sum(dim=1, dtype=torch.float32)  # [T, H]

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Destination tensor of each FFN block name (gate, owned experts, shared
        experts)."""
        tensors = {}
        if self.gate is not None:
            tensors.update({f"gate.{name}": t for name, t in self.gate.state_dict(keep_vars=True).items()})
        tensors.update(self.experts.checkpoint_tensors())
        if self.shared_experts is not None:
            tensors.update({f"shared_experts.{n}": t for n, t in self.shared_experts.checkpoint_tensors().items()})
        return tensors


@functools.cache
def _side_stream(device: torch.device, stream: int) -> torch.cuda.Stream:
    """The side stream on which `MoE.begin_shared` runs for work queued on `stream`
    (a CUDA stream handle) of `device`: one per stream, so that work on two streams
    (e.g. two micro-batches) never waits for each other's shared experts. torch hands
    out its pooled streams round-robin (32 per device), so a new one may be `stream`
    itself, which would run the shared experts in line (`pooled_stream_other_than`)."""
    return pooled_stream_other_than(device, stream)
