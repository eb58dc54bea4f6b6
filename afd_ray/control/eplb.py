"""EPLB in the coordinator: the FFN pool's expert load, its balancedness, and live
rebalancing of the expert placement (docs/eplb.md).

Each FFN rank reports the routed rows of its own tokens per (MoE layer, expert) over
its last `ffn.eplb.window_size` steps (`StepMeter.window_load`); the sum over the ranks
of the serving layout is the pool's load. Its balancedness per layer (mean over max of
the EP ranks' routed rows under the placement in use) is in `/afd/status` (`eplb`) and
the `afd_eplb_balancedness` gauge.

A rebalance (`POST /afd/eplb`, or the policy: every `step_interval` FFN steps while the
mean balancedness is under `balancedness_bound`) computes the new placement with
`afd_ray.eplb.policy.rebalance` and switches to it the way an FFN resize does
(`Resizer.relayout`): a new layout epoch over the same FFN ranks, each rank loading its
new slots beside the old ones (copying what it holds, reading the rest from the
checkpoint) while the old layout serves, all switching at one agreed step boundary.
Any other layout change (resize, recovery) returns to the contiguous placement.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from afd_ray.config.eplb import EPLBConfig
from afd_ray.control.membership import EPAssignment, FFNDirective
from afd_ray.control.registry import Registry
from afd_ray.control.resize import Resizer
from afd_ray.eplb.slots import Slots, default_slots, layer_balancedness, rank_rows, redundant_for
from afd_ray.eplb.policy import LayerPlacement, rebalance
from afd_ray.eplb.records import EPLBEvent, EPLBStatus
from afd_ray.observability.metrics import MetricSet

__all__ = ["EPLBController"]

logger = logging.getLogger("ray.serve")

_PERIOD_S = 0.5
"""How often the balancedness is exported and the policy checked, seconds."""


class EPLBController:
    """The coordinator's EPLB: load aggregation, status, metric, policy, rebalances.

    Args:
        config: `ffn.eplb`.
        registry: the FFN ranks and the serving layout.
        resizer: switches the FFN layout (`Resizer.relayout`).
        metrics: export `afd_eplb_balancedness` (`observability.metrics`).
    """

    def __init__(self, config: EPLBConfig, registry: Registry, resizer: Resizer, metrics: bool) -> None:
        self._config = config
        self._registry = registry
        self._resizer = resizer
        self._metrics = MetricSet(("afd_eplb_balancedness",)) if metrics else None
        self._loads: dict[int, list[list[int]]] = {}
        """Each FFN rank's latest window `[L][E]`."""
        self._placements: dict[int, tuple[Slots, ...]] = {}
        """The placement of each layout epoch a rebalance made (others: contiguous)."""
        self.events: list[EPLBEvent] = []
        self._checked_at = 0
        """FFN steps of the serving layout's first rank at the last policy check."""

    def report(self, rank: int, load: Sequence[Sequence[int]] | None) -> None:
        """FFN rank `rank`'s window load `[L][E]` (None or empty: a dense model)."""
        if load:
            self._loads[rank] = [list(rows) for rows in load]

    def placed(self, epoch: int) -> tuple[Slots, ...] | None:
        """The placement of layout `epoch` (None: contiguous blocks)."""
        return self._placements.get(epoch)

    def assign(self, assignment: EPAssignment) -> EPAssignment:
        """`assignment` with the placement of its layout epoch."""
        placed = self.placed(assignment.epoch)
        return assignment if placed is None else assignment.model_copy(update={"placements": placed})

    def directive(self, directive: FFNDirective) -> FFNDirective:
        """`directive` with the placement of the layout it asks the rank to prepare."""
        plan = directive.plan
        if plan is None or plan.assignment is None:
            return directive
        return directive.model_copy(
            update={"plan": plan.model_copy(update={"assignment": self.assign(plan.assignment)})}
        )

    def _window(self) -> tuple[list[list[int]], tuple[Slots, ...]] | None:
        """The pool's window load `[L][E]` over the serving layout's ranks, and the
        placement in use; None before any routed row was reported (a dense model, or
        MoE ranks that served no step yet and report windows of zeros)."""
        registry = self._registry
        loads = [self._loads[r] for r in registry.layout if r in self._loads]
        total = [[sum(rows) for rows in zip(*layer, strict=True)] for layer in zip(*loads, strict=True)]
        if not any(map(any, total)):
            return None
        placed = self.placed(registry.layout_epoch)
        if placed is None:
            placed = (default_slots(len(total[0]), len(registry.layout)),) * len(total)
        return total, placed

    def status(self) -> EPLBStatus | None:
        """What `/afd/status` shows (None: no MoE load reported yet)."""
        window = self._window()
        if window is None:
            return None
        load, placed = window
        per_rank = [rank_rows(slots, rows) for rows, slots in zip(load, placed, strict=True)]
        num_experts = len(load[0])
        return EPLBStatus(
            enabled=self._config.enabled,
            balancedness=layer_balancedness(load, placed),
            rank_rows=[sum(rows) for rows in zip(*per_rank, strict=True)],
            window_rows=sum(map(sum, load)),
            num_redundant_experts=sum(map(len, placed[0])) - num_experts,
            placements=[[list(rank) for rank in slots] for slots in placed]
            if self.placed(self._registry.layout_epoch)
            else [],
            rebalances=self.events,
        )

    async def rebalance(self, reason: str) -> EPLBEvent:
        """Compute the placement of the window's load and switch to it (module
        docstring); layers that would gain less than `min_gain` keep theirs. Returns
        the event (also kept in `events`): `epoch` None when nothing moved, `error`
        set when it could not (no MoE load reported yet, experts that do not split
        evenly over the FFN ranks, a resize under way, the switch failed)."""
        started = time.time()
        window = self._window()
        if window is None:
            return self._failed(reason, started, "no expert load reported yet (a dense model, or no FFN step served)")
        load, placed = window
        ep_size, num_experts = len(placed[0]), len(load[0])
        redundant = redundant_for(num_experts, ep_size, self._config.num_redundant_experts)
        if redundant is None or len({len(rank) for rank in placed[0]}) != 1:
            message = f"{num_experts} experts do not split evenly over {ep_size} FFN ranks: no EPLB placement"
            return self._failed(reason, started, message)
        current = [LayerPlacement(num_experts, slots) for slots in placed]
        proposed = rebalance(load, current, redundant, self._config.min_gain)
        before = _mean(layer_balancedness(load, placed))
        moved = sum(new is not old for new, old in zip(proposed, current, strict=True))
        after = _mean(layer_balancedness(load, [p.slots for p in proposed]))
        event = EPLBEvent(reason=reason, started_s=started, layers_moved=moved, balancedness_before=before)
        if moved:
            slots = tuple(p.slots for p in proposed)
            try:
                epoch, pause_s, num_bytes = await self._resizer.relayout(
                    lambda e: self._placements.__setitem__(e, slots)
                )
                event = event.model_copy(update={"epoch": epoch, "pause_s": pause_s, "bytes_loaded": num_bytes})
            except Exception as exc:
                logger.exception("EPLB rebalance failed")
                event = event.model_copy(update={"error": f"{type(exc).__name__}: {exc}"})
        event = event.model_copy(
            update={
                "balancedness_after": after if moved and event.error is None else before,
                "duration_s": time.time() - started,
            }
        )
        self.events.append(event)
        logger.info("EPLB rebalance: %s", event.model_dump_json())
        return event

    def _failed(self, reason: str, started: float, error: str) -> EPLBEvent:
        event = EPLBEvent(reason=reason, started_s=started, error=error)
        self.events.append(event)
        logger.warning("EPLB rebalance (%s) not done: %s", reason, error)
        return event

    async def run(self) -> None:
        """Forever: export the balancedness per layer; with `enabled`, every
        `step_interval` FFN steps rebalance if the mean is under `balancedness_bound`."""
        while True:
            await asyncio.sleep(_PERIOD_S)
            try:
                await self._evaluate()
            except Exception:  # a bad report must not end the loop (and the metric)
                logger.exception("EPLB evaluation failed")

    async def _evaluate(self) -> None:
        """Export the balancedness; rebalance if the policy is due and under its bound."""
        config, registry = self._config, self._registry
        status = self.status()
        if status is None:
            return
        if self._metrics is not None:
            for layer, value in enumerate(status.balancedness):
                self._metrics.set("afd_eplb_balancedness", value, {"layer": str(layer)})
        steps = registry.ffn[registry.layout[0]].steps if registry.layout else 0
        self._checked_at = min(self._checked_at, steps)  # the first rank changed
        if not config.enabled or steps - self._checked_at < config.step_interval:
            return
        self._checked_at = steps
        mean = _mean(status.balancedness)
        if config.log_balancedness:
            logger.info("EPLB balancedness %.3f, per MoE layer %s", mean, [round(b, 3) for b in status.balancedness])
        if mean < config.balancedness_bound and not self._resizer.busy:
            await self.rebalance("policy")


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 1.0
