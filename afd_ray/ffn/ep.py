"""Expert parallelism among FFN ranks: step agreement, MoE dispatch and combine.

FFN ranks of one EP group run every step together (lockstep): before a step they
all-reduce their local token counts (`agree`), and every rank, even one with no
local tokens, then runs every layer, because each MoE layer needs all of them in
two all-to-alls:

1. dispatch: each (token, k) row goes to the EP rank owning its expert, with its
   expert id and routing weight (splits may be uneven or empty);
2. the owner computes its experts on what it received (`MoE.experts`);
3. combine: rows return to their source rank, which sums each token's k rows in
   float32 in the same order as the single-rank `MoE.forward`, then adds the
   replicated shared experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from afd_ray.ffn.moe import MoE
from afd_ray.ffn.placement import expert_owner
from afd_ray.ffn.routing import Routing

__all__ = ["EPGroup"]


class EPGroup:
    """One FFN rank's view of its EP group.

    Args:
        group: process group over the EP ranks (gloo | nccl | hccl).
        num_experts: routed experts per MoE layer (same placement every layer).
        device: device of the FFN model.
    """

    def __init__(self, group: dist.ProcessGroup, num_experts: int, device: torch.device) -> None:
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self._owner = torch.tensor(expert_owner(num_experts, self.size), device=device)  # [E]
        self._device = device
        self.all_ready = False
        """Whether every EP rank passed `ready=True` to the last `agree()`."""

    def agree(self, local_tokens: int, ready: bool = False) -> int:
        """Sum of every EP rank's token count for the next step (0: nobody steps).

        One all-reduce of `[local_tokens, ready]`; it also sets `all_ready`: whether
        every EP rank passed `ready=True` (the group then switches to its next
        layout after this step, `afd_ray.ffn.runtime`).
        """
        count = torch.tensor([local_tokens, int(ready)], dtype=torch.int64)
        self.group.allreduce([count]).wait()
        self.all_ready = int(count[1]) == self.size
        return int(count[0])

    def _all_to_all(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        recv = send.new_empty((sum(recv_splits), *send.shape[1:]))
        self.group.alltoall_base(recv, send, recv_splits, send_splits).wait()
        return recv

    def moe(self, moe: MoE, hidden: torch.Tensor, routing: Routing) -> torch.Tensor:
        """The MoE layer over the EP group for this rank's tokens.

        Args:
            moe: the layer, holding this rank's experts (block `expert_owner` gives it).
            hidden: `[N, H]` this rank's rows (N may be 0), model dtype.
            routing: `moe.route(hidden)`: ids `[N, k]` int64, weights `[N, k]` float32.

        Returns:
            `[N, H]`, model dtype: what the full MoE returns for `hidden`.
        """
        num_tokens, hidden_size = hidden.shape
        top_k = routing.ids.shape[1]
        dest = self._owner[routing.ids.flatten()]  # [N*k] owner rank of each row
        order = torch.argsort(dest, stable=True)  # [N*k] rows grouped by owner
        send_splits = torch.bincount(dest, minlength=self.size)  # [P]
        recv_splits = torch.empty_like(send_splits)
        self.group.alltoall_base(recv_splits, send_splits, [1] * self.size, [1] * self.size).wait()
        send_splits, recv_splits = send_splits.tolist(), recv_splits.tolist()

        token_of_row = order // top_k  # [N*k] source token of each sorted row
        rows = self._all_to_all(hidden[token_of_row], send_splits, recv_splits)  # [M, H]
        ids = self._all_to_all(routing.ids.flatten()[order], send_splits, recv_splits)  # [M]
        weights = self._all_to_all(routing.weights.flatten()[order], send_splits, recv_splits)  # [M]
        out = moe.experts(rows, ids, weights)  # [M, H]
        back = self._all_to_all(out, recv_splits, send_splits)  # [N*k, H], sorted by owner

        unsorted = torch.empty_like(back)
        unsorted[order] = back  # [N*k, H]; row t*k+j is token t's j-th expert
        combined = unsorted.view(num_tokens, top_k, hidden_size).sum(dim=1, dtype=torch.float32)  # [N, H]
        shared = moe.shared(hidden)
        if shared is not None:
            combined += shared
        return combined.to(hidden.dtype)
