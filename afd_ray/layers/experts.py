"""The routed experts of one MoE layer that one EP rank holds, computed as grouped GEMMs."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

__all__ = ["ExpertSlots", "Experts", "SlotTables"]

_PROJ = ("gate_proj", "up_proj", "down_proj")


class ExpertSlots(NamedTuple):
    """One EP rank's physical expert slots of one MoE layer, and how the rows of a
    replicated expert are split over its replicas (EPLB, docs/eplb.md).

    Row n of the rows every EP rank sees (`EPGroup.moe`: the same `[P*B*k]` rows on
    every rank) routed to logical expert e is computed by replica `n % replicas[e]`
    of e, and only there; replica j of e is the j-th slot holding e when the EP ranks'
    slots are read in rank order, then slot order. So each row is computed by exactly
    one rank and the sum over the ranks is the full MoE's.
    """

    experts: tuple[int, ...]
    """Logical expert of each local slot (a slot's weights are that expert's)."""
    replica: tuple[int, ...]
    """Which replica of its expert each local slot is, in `[0, replicas[e])`."""
    replicas: tuple[int, ...]
    """`[E]`: physical slots of each logical expert over the whole EP group (>= 1)."""

    @classmethod
    def block(cls, owned: range, num_experts: int) -> ExpertSlots:
        """The contiguous block `owned` of `num_experts` experts, one replica each."""
        return cls(tuple(owned), (0,) * len(owned), (1,) * num_experts)

    def table(self) -> list[list[int]]:
        """`[E][max(replicas)]`: the local slot holding replica j of expert e, or
        `len(experts)` where another rank holds it (or e has fewer replicas)."""
        absent = len(self.experts)
        table = [[absent] * max(self.replicas) for _ in self.replicas]
        for slot, (expert, replica) in enumerate(zip(self.experts, self.replica, strict=True)):
            table[expert][replica] = slot
        return table


class SlotTables:
    """`ExpertSlots.table()` `[E, R]` and `replicas` `[E]` as int64 tensors on the
    device of the rows, made at the first forward there (before any CUDA graph capture;
    the module holding them may be built on meta) and reused after."""

    def __init__(self, slots: ExpertSlots) -> None:
        self._slots = slots
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """`(table [E, R], replicas [E])` on `device`."""
        if self._tables is None or self._tables[0].device != device:
            table = torch.tensor(self._slots.table(), dtype=torch.int64, device=device)
            replicas = torch.tensor(self._slots.replicas, dtype=torch.int64, device=device)
            self._tables = (table, replicas)
        return self._tables


class Experts(nn.Module):
    """Gated-MLP experts in the physical slots `slots` gives this rank, stacked.

    Parameters (only this rank's slots are allocated; replicas hold equal weights):
        gate_up: `[S, 2 * I, H]` (S = `len(slots.experts)`), rows `[:I]` the
            checkpoint's `experts.{e}.gate_proj.weight` of the slot's expert e, rows
            `[I:]` its `up_proj.weight` (transformers' fused layout).
        down: `[S, H, I]`, the checkpoint's `experts.{e}.down_proj.weight`.

    Raises:
        ValueError: no slot, or `slots` disagree on the slot count.
        KeyError: `hidden_act` is not a transformers activation name.
    """

    def __init__(
        self, slots: ExpertSlots, hidden_size: int, intermediate_size: int, hidden_act: str, dtype: torch.dtype
    ) -> None:
        super().__init__()
        if not slots.experts or len(slots.replica) != len(slots.experts):
            raise ValueError(f"expert slots must be non-empty, one replica index per slot; got {slots}")
        self.slots = slots
        self.owned = slots.experts
        """Logical expert of each local slot (`ExpertSlots.experts`)."""
        self.intermediate_size = intermediate_size
        gate_up_shape = (len(self.owned), 2 * intermediate_size, hidden_size)
        self.gate_up = nn.Parameter(torch.empty(gate_up_shape, dtype=dtype), requires_grad=False)
        down_shape = (len(self.owned), hidden_size, intermediate_size)
        self.down = nn.Parameter(torch.empty(down_shape, dtype=dtype), requires_grad=False)
        self.act_fn = ACT2FN[hidden_act]
        self._tables = SlotTables(slots)

    def forward(self, rows: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Weighted expert outputs of `rows`; rows this rank does not compute give zeros.

        Args:
            rows: `[N, H]` hidden states in the model dtype, one row per (token, expert).
            expert_ids: `[N]` int64 global expert id of each row.
            weights: `[N]` float32 routing weight of each row.

        Returns:
            `[N, H]` in the model dtype, in the order of `rows`:
            `weights[n] * expert[expert_ids[n]](rows[n])`, or 0 where this rank holds
            no slot of `expert_ids[n]`, or where row n goes to a replica on another
            rank (`ExpertSlots`). Summing the outputs of every EP rank therefore gives
            the full MoE's rows.

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
        table, replicas = self._tables.on(expert_ids.device)  # [E, R], [E]
        if table.shape[1] == 1:  # no replicas: one slot per expert
            local = table[:, 0][expert_ids]  # [N] local slot, num_local: computed elsewhere
        else:
            row = torch.arange(expert_ids.shape[0], device=expert_ids.device)  # [N]
            local = table[expert_ids, row % replicas[expert_ids]]  # [N] local slot, num_local: computed elsewhere
        key, order = torch.sort(local, stable=True)  # [N]; not computed here last
        local_ids = torch.arange(num_local, device=key.device)  # [E_local]
        ends = torch.searchsorted(key, local_ids, right=True).to(torch.int32)  # [E_local] end row per expert
        # grouped_mm leaves rows >= ends[-1] (not computed here) undefined; masked below.
        gate_up = F.grouped_mm(rows[order], self.gate_up.transpose(1, 2), offs=ends)  # [N, 2I]
        gate, up = gate_up.split(self.intermediate_size, dim=-1)  # [N, I] each
        out = F.grouped_mm(self.act_fn(gate) * up, self.down.transpose(1, 2), offs=ends)  # [N, H]
        out = torch.where((key < num_local).unsqueeze(-1), out * weights[order].unsqueeze(-1), 0.0)
        return torch.empty_like(rows).index_copy_(0, order, out.to(rows.dtype))

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Destination view of each held expert's checkpoint tensor, by FFN block
        name (`experts.{e}.gate_proj.weight`, ...; Mixtral's `w1`/`w3`/`w2` are
        renamed by `afd_ray.weights.ffn_block_name`): an expert's first local slot;
        `copy_replicas` fills its other local slots, if any."""
        inter = self.intermediate_size
        views = {}
        for local, expert in enumerate(self.owned):
            if f"experts.{expert}.{_PROJ[0]}.weight" in views:
                continue
            for proj, view in zip(
                _PROJ, (self.gate_up[local, :inter], self.gate_up[local, inter:], self.down[local]), strict=True
            ):
                views[f"experts.{expert}.{proj}.weight"] = view
        return views

    def copy_replicas(self) -> None:
        """Copy each expert's first local slot into its other local slots (a rank
        holds two replicas of one expert only when the placement had no other room)."""
        first: dict[int, int] = {}
        with torch.no_grad():
            for slot, expert in enumerate(self.owned):
                if expert in first:
                    self.gate_up[slot].copy_(self.gate_up[first[expert]])
                    self.down[slot].copy_(self.down[first[expert]])
                else:
                    first[expert] = slot
