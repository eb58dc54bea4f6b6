"""The routed experts of one MoE layer that one EP rank owns, computed as grouped GEMMs."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

__all__ = ["Experts"]

_PROJ = ("gate_proj", "up_proj", "down_proj")


class Experts(nn.Module):
    """Gated-MLP experts `owned` (a contiguous block of expert ids), stacked.

    Parameters (only the owned experts are allocated):
        gate_up: `[len(owned), 2 * I, H]`, rows `[:I]` the checkpoint's
            `experts.{e}.gate_proj.weight`, rows `[I:]` its `up_proj.weight`
            (transformers' fused layout).
        down: `[len(owned), H, I]`, the checkpoint's `experts.{e}.down_proj.weight`.

    Raises:
        ValueError: `owned` is empty or has a step other than 1.
        KeyError: `hidden_act` is not a transformers activation name.
    """

    def __init__(
        self, owned: range, hidden_size: int, intermediate_size: int, hidden_act: str, dtype: torch.dtype
    ) -> None:
        super().__init__()
        if len(owned) == 0 or owned.step != 1:
            raise ValueError(f"owned experts must be a non-empty contiguous range, got {owned}")
        self.owned = owned
        self.intermediate_size = intermediate_size
        gate_up_shape = (len(owned), 2 * intermediate_size, hidden_size)
        self.gate_up = nn.Parameter(torch.empty(gate_up_shape, dtype=dtype), requires_grad=False)
        down_shape = (len(owned), hidden_size, intermediate_size)
        self.down = nn.Parameter(torch.empty(down_shape, dtype=dtype), requires_grad=False)
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, rows: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Weighted expert outputs of `rows`; rows of experts not owned give zeros.

        Args:
            rows: `[N, H]` hidden states in the model dtype, one row per (token, expert).
            expert_ids: `[N]` int64 global expert id of each row.
            weights: `[N]` float32 routing weight of each row.

        Returns:
            `[N, H]` in the model dtype, in the order of `rows`:
            `weights[n] * expert[expert_ids[n]](rows[n])`, or 0 where this rank does
            not own `expert_ids[n]`. Summing the outputs of every EP rank therefore
            gives the full MoE's rows.

        The rows are sorted by expert and run as two `torch.nn.functional.grouped_mm`
        (one per projection). On CPU (torch 2.13, any float dtype) this is as fast as a
        Python loop over the experts that have rows. On CUDA, bfloat16 on SM 9.x/10.x
        runs torch's CUTLASS grouped GEMM with no host synchronization, so the layer
        can be captured in a CUDA graph; it needs 16-byte aligned strides (H and I
        multiples of 8) and takes groups of any size, empty ones too (the int32 `offs`
        are group ends; rows past the last end are left undefined and masked here).
        Other dtypes or GPUs take torch's fallback, a loop over groups that copies
        `offs` to the host (correct, not capturable).
        """
        num_local = len(self.owned)
        local = expert_ids - self.owned.start  # [N]
        owned = (local >= 0) & (local < num_local)  # [N]
        key, order = torch.sort(torch.where(owned, local, num_local), stable=True)  # [N]; not owned last
        local_ids = torch.arange(num_local, device=key.device)  # [E_local]
        ends = torch.searchsorted(key, local_ids, right=True).to(torch.int32)  # [E_local] end row per expert
        # grouped_mm leaves rows >= ends[-1] (experts not owned) undefined; masked below.
        gate_up = F.grouped_mm(rows[order], self.gate_up.transpose(1, 2), offs=ends)  # [N, 2I]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # [N, I] each
        out = F.grouped_mm(self.act_fn(gate) * up, self.down.transpose(1, 2), offs=ends)  # [N, H]
        out = torch.where((key < num_local).unsqueeze(-1), out * weights[order].unsqueeze(-1), 0.0)
        return torch.empty_like(rows).index_copy_(0, order, out.to(rows.dtype))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Destination view of each owned expert's checkpoint tensor, by FFN block
        name (`experts.{e}.gate_proj.weight`, ...; Mixtral's `w1`/`w3`/`w2` are
        renamed by `afd_ray.weights.ffn_block_name`)."""
        inter = self.intermediate_size
        views = {}
        for local, expert in enumerate(self.owned):
            for proj, view in zip(
                _PROJ, (self.gate_up[local, :inter], self.gate_up[local, inter:], self.down[local]), strict=True
            ):
                views[f"experts.{expert}.{proj}.weight"] = view
        return views
