"""Expert parallelism among FFN ranks: step agreement, then each MoE layer over the
EP group with static shapes.

FFN ranks of one EP group run every step together (lockstep): before a step they
all-reduce their local token counts (`agree`), and every rank, even one with no
local tokens, then runs every layer with the same row count B (each pads its rows to
B, at least the largest local count), because each MoE layer needs all of them in two
collectives (vLLM's `allgather_reducescatter` all2all backend):

1. all-gather: every rank gets the `[B, H]` rows and the top-k ids and weights of
   every EP rank, `[P*B, ...]`;
2. each rank computes its own expert slots on all `P*B*k` (token, expert) rows
   (`Experts.forward` gives zeros for experts it does not hold, and for rows of a
   replicated expert that another replica computes: `ExpertSlots`, EPLB) and sums
   each token's k rows in float32;
3. reduce-scatter (sum): each rank gets back its own B tokens, summed over the EP
   ranks in float32, then adds the replicated shared experts (`MoE.output`).

Shapes depend on B alone, with no host synchronization, so a layer can be captured
in a CUDA graph per B (`afd_ray.ffn.graphs`). The traffic is `(P-1)*B*(H*dtype +
k*12)` bytes in and `(P-1)*B*H*4` out per rank and layer, against about `B*k*H*dtype`
each way for an all-to-all dispatch of only the routed rows; at decode sizes both are
latency-bound, and the all-to-all needs its split sizes on the host.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from afd_ray.eplb.contiguous import expert_owner
from afd_ray.layers.moe import MoE
from afd_ray.layers.routing import Routing

__all__ = ["EPGroup"]


class EPGroup:
    """One FFN rank's view of its EP group.

    Args:
        group: process group over the EP ranks (gloo | nccl | hccl).
        num_experts: routed experts per MoE layer (same placement every layer).
        device: device of the FFN model (the collectives' tensors live there).

    Raises:
        ValueError: more EP ranks than experts (`placement.expert_owner`).
    """

    def __init__(self, group: dist.ProcessGroup, num_experts: int, device: torch.device) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        expert_owner(num_experts, self.size)
        self._device = device
        self.step_tokens: tuple[int, ...] = (0,) * self.size
        """Local token count of every EP rank in the step of the last `agree()`; every
        rank pads its rows to at least `max(step_tokens)` for that step."""
        self.all_ready = False
        """Whether every EP rank passed `ready=True` to the last `agree()`: the group
        switches to its next layout after that step (`afd_ray.ffn.layout`)."""
        self.first_layer = 0
        """The layer the step of the last `agree()` starts at: the largest `first_layer`
        of the ranks that have tokens (0 when none has). Every rank runs the layers from
        there, including a rank with no local step; a rank whose local step starts at
        another layer takes part without rows (`step_tokens` 0) and keeps its step for
        a later agreement."""
        self.collective_s = 0.0
        """Host time spent waiting in the MoE layers' all-gathers and reduce-scatters
        since start, seconds (on CUDA: launch time; inside a captured graph: none)."""

    def agree(self, local_tokens: int, ready: bool = False, first_layer: int = 0) -> int:
        """Sum of the token counts of the EP ranks that take part in the next step
        (0: nobody steps).

        One all-reduce of a `[2P+1]` int64 vector (this rank's count at its rank, its
        `ready` flag added at P, its step's `first_layer` at P+1+rank), then a host
        read; it also sets `step_tokens`, `all_ready` and `first_layer`. Ranks whose
        step starts at another layer than the agreed `first_layer` (steps resumed at a
        later layer after an FFN rank was lost, beside fresh ones) count 0 tokens in
        `step_tokens`: every rank computes the same choice from the same vector.
        """
        counts = torch.zeros(2 * self.size + 1, dtype=torch.int64, device=self._device)  # [2P+1]
        counts[self.rank] = local_tokens
        counts[self.size] = int(ready)
        counts[self.size + 1 + self.rank] = first_layer
        self.group.allreduce([counts]).wait()
        values = counts.tolist()
        tokens, num_ready, firsts = values[: self.size], values[self.size], values[self.size + 1 :]
        self.all_ready = num_ready == self.size
        self.first_layer = max((f for t, f in zip(tokens, firsts) if t > 0), default=0)
        self.step_tokens = tuple(t if f == self.first_layer else 0 for t, f in zip(tokens, firsts))
        return sum(self.step_tokens)

    def _all_gather(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every EP rank's rows of several tensors in one all-gather: each `[B, ...]`
        in, each `[P*B, ...]` out (rank r's rows at `[r*B, (r+1)*B)`), same dtypes."""
        rows = parts[0].shape[0]
        flat = [part.reshape(rows, math.prod(part.shape[1:])).view(torch.uint8) for part in parts]  # [B, bytes_i]
        send = torch.cat(flat, dim=1)  # [B, Σ bytes_i]
        recv = send.new_empty(self.size * rows, send.shape[1])  # [P*B, Σ bytes_i]
        start = time.perf_counter()
        self.group._allgather_base(recv, send).wait()
        self.collective_s += time.perf_counter() - start
        gathered = []
        for part, piece in zip(parts, recv.split([f.shape[1] for f in flat], dim=1), strict=True):
            gathered.append(piece.contiguous().view(part.dtype).view(self.size * rows, *part.shape[1:]))
        return gathered

    def moe(self, moe: MoE, hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The MoE layer over the EP group for this rank's (padded) rows.

        Every EP rank must call this for the same layer with the same row count B
        (`hidden.shape[0]`); padding rows may hold any finite values, their outputs
        are to be dropped by the caller.

        Args:
            moe: the layer, holding this rank's expert slots (`ExpertSlots`).
            hidden: `[B, H]` this rank's rows, model dtype.
            routing: ids `[B, k]` int64 and weights `[B, k]` float32 of those rows
                (`moe.route(hidden)`, or received with `gate_on_attention`).

        Returns:
            `[B, H]` (`[B, P, H]` with `moe.split_output`), model dtype: what the full
            MoE returns for `hidden`, except that a token's routed rows are summed per
            computing rank first (float32), so sums may differ from `MoE.forward` in
            the last float32 bit.
        """
        rows_per_rank, hidden_size = hidden.shape
        top_k = routing.ids.shape[1]
        all_hidden, all_ids, all_weights = self._all_gather([hidden, routing.ids, routing.weights])  # [P*B, ...]
        rows = all_hidden.unsqueeze(1).expand(-1, top_k, -1).reshape(-1, hidden_size)  # [P*B*k, H]
        out = moe.experts(rows, all_ids.flatten(), all_weights.flatten())  # [P*B*k, H]; 0 where not owned
        partial = out.view(-1, top_k, hidden_size).sum(dim=1, dtype=torch.float32)  # [P*B, H]
        combined = partial.new_empty(rows_per_rank, hidden_size)  # [B, H] float32
        start = time.perf_counter()
        self.group._reduce_scatter_base(combined, partial).wait()  # sum over EP ranks
        self.collective_s += time.perf_counter() - start
        return moe.output(combined, moe.shared(hidden), hidden.dtype)
