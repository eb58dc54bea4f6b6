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
An FFN rank found dead meanwhile ends the rebalance (its plan is dropped, the event
carries the error) so that the recovery re-forms the layout at once.

Any other layout change (a resize, a recovery) keeps the placement policy while EPLB
is in use (`ffn.eplb.enabled`, or the serving layout holds a rebalanced placement):
its new layout's placement is the policy's for the new EP size from the window's load
(`afd_ray.eplb.layouts.layout_placement`, against the serving placement when the size
stays); else, or with no load in the window, the contiguous blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Sequence

from afd_ray.config.eplb import EPLBConfig
from afd_ray.control.membership import EPAssignment, FFNDirective
from afd_ray.control.registry import Registry
from afd_ray.control.resize import Resizer
from afd_ray.eplb.layouts import layout_placement
from afd_ray.eplb.slots import Slots, default_slots, layer_balancedness, rank_rows, redundant_for
from afd_ray.eplb.records import EPLBEvent, EPLBStatus
from afd_ray.observability.metrics import MetricSet

__all__ = ["EPLBController", "check_redundant"]

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
        dead: FFN ranks found dead now (`Recovery.dead`): a rebalance ends when one
            of its layout is.
    """

    def __init__(
        self,
        config: EPLBConfig,
        registry: Registry,
        resizer: Resizer,
        metrics: bool,
        dead: Callable[[], Collection[int]] = tuple,
    ) -> None:
        self._config = config
        self._registry = registry
        self._resizer = resizer
        self._dead = dead
        self._metrics = MetricSet(("afd_eplb_balancedness",)) if metrics else None
        self._loads: dict[int, list[list[int]]] = {}
        """Each FFN rank's latest window `[L][E]`."""
        self._placements: dict[int, tuple[Slots, ...] | None] = {}
        """The placement of each layout epoch a rebalance, resize or recovery planned
        (None, or an epoch not here: contiguous)."""
        self.events: list[EPLBEvent] = []
        self._checked_at = 0
        """FFN steps of the serving layout's first rank at the last policy check."""

    def report(self, rank: int, load: Sequence[Sequence[int]] | None) -> None:
        """FFN rank `rank`'s window load `[L][E]` (None or empty: a dense model)."""
        if load:
            self._loads[rank] = [list(rows) for rows in load]

    def rejoined(self, epoch: int, placements: Sequence[Slots] | None) -> None:
        """An FFN rank rejoined this (restarted) coordinator serving the layout of
        `epoch` with `placements` (None: contiguous): the placement of that layout,
        which every rank of it holds, unless known already."""
        held = None if placements is None else tuple(tuple(tuple(rank) for rank in slots) for slots in placements)
        self._placements.setdefault(epoch, held)

    def placed(self, epoch: int) -> tuple[Slots, ...] | None:
        """The placement of layout `epoch` (None: contiguous blocks)."""
        return self._placements.get(epoch)

    def assign(self, assignment: EPAssignment) -> EPAssignment:
        """`assignment` with the placement of its layout epoch; the first one of a
        pending plan's epoch fixes that layout's placement (`_new_layout`), so every
        rank of it gets the same."""
        plan = self._registry.plan
        if plan is not None and assignment.epoch == plan.epoch and plan.epoch not in self._placements:
            self._placements[plan.epoch] = self._new_layout(len(plan.ranks))
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

    def _new_layout(self, ep_size: int) -> tuple[Slots, ...] | None:
        """The placement of a resize's or recovery's new layout of `ep_size` ranks
        (module docstring): the contiguous blocks unless EPLB is in use."""
        registry = self._registry
        serving = self.placed(registry.layout_epoch)
        ranks = (*registry.formed_layout(), *registry.layout)  # a lost rank's last window too
        window = self._window(ranks) if self._config.enabled or serving is not None else None
        if window is None:
            return None
        current = serving if serving is not None and len(serving[0]) == ep_size else None
        placed = layout_placement(
            window[0], ep_size, self._config.num_redundant_experts, self._config.min_gain, current
        )
        logger.info("EPLB: the FFN layout of %d ranks takes placement %s", ep_size, placed or "contiguous")
        return placed

    def _window(self, ranks: Sequence[int] | None = None) -> tuple[list[list[int]], tuple[Slots, ...]] | None:
        """The pool's window load `[L][E]` over the serving layout's ranks (or
        `ranks`), and the placement in use; None before any routed row was reported
        (a dense model, or MoE ranks that served no step yet and report windows of
        zeros)."""
        registry = self._registry
        loads = [self._loads[r] for r in dict.fromkeys(registry.layout if ranks is None else ranks) if r in self._loads]
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
            num_redundant_experts=max(sum(map(len, slots)) for slots in placed) - num_experts,
            placements=[[list(rank) for rank in slots] for slots in placed]
            if self.placed(self._registry.layout_epoch)
            else [],
            rebalances=self.events,
        )

    async def rebalance(self, reason: str, num_redundant_experts: int | None = None) -> EPLBEvent:
        """Compute the placement of the window's load and switch to it (module
        docstring); layers that would gain less than `min_gain` keep theirs.

        Args:
            reason: `manual` (POST /afd/eplb) or `policy`, as the event shows it.
            num_redundant_experts: redundant slots per MoE layer of this placement, in
                `[0, ffn.eplb.num_redundant_experts]` (the count the deployment is sized
                for); None: the configured count. This EP size uses `redundant_for` of
                it. A later resize, recovery or policy rebalance uses the configured one.

        Returns:
            The event (also kept in `events`): `epoch` None when nothing moved, `error`
            set when it could not (no MoE load reported yet, no EPLB placement at this
            EP size (`redundant_for`), a resize or recovery under way, a rank of the
            layout found dead before the switch, the switch failed).

        Raises:
            ValueError: `num_redundant_experts` outside its range (names the field).
        """
        config = self._config
        wanted = config.num_redundant_experts if num_redundant_experts is None else num_redundant_experts
        check_redundant(wanted, config)
        started = time.time()
        resizer, window = self._resizer, self._window()
        if resizer.busy or resizer.layout_lock.locked() or self._registry.plan is not None:
            return self._failed(
                reason, started, "the FFN layout is changing (a resize or recovery): retry once it serves"
            )
        if window is None:
            return self._failed(reason, started, "no expert load reported yet (a dense model, or no FFN step served)")
        load, placed = window
        ep_size, num_experts = len(placed[0]), len(load[0])
        if redundant_for(num_experts, ep_size, wanted) is None:
            message = f"{num_experts} experts do not split evenly over {ep_size} FFN ranks: no EPLB placement"
            return self._failed(reason, started, message)
        slots = layout_placement(load, ep_size, wanted, config.min_gain, placed)
        slots = slots or (default_slots(num_experts, ep_size),) * len(load)
        before = _mean(layer_balancedness(load, placed))
        moved = sum(new != old for new, old in zip(slots, placed, strict=True))
        after = _mean(layer_balancedness(load, slots))
        event = EPLBEvent(reason=reason, started_s=started, layers_moved=moved, balancedness_before=before)
        if moved:
            try:
                epoch, pause_s, num_bytes = await self._resizer.relayout(
                    lambda e: self._placements.__setitem__(e, slots), self._dead
                )
                event = event.model_copy(update={"epoch": epoch, "pause_s": pause_s, "bytes_loaded": num_bytes})
            except Exception as exc:
                logger.exception("EPLB rebalance failed")
                event = event.model_copy(update={"error": str(exc) or type(exc).__name__, "layers_moved": 0})
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


def check_redundant(num_redundant_experts: int, config: EPLBConfig) -> None:
    """Raises ValueError, its message beginning with the field, when a rebalance's
    `num_redundant_experts` is negative or over `ffn.eplb.num_redundant_experts`: the
    deployment's memory (one expert's weights per replica and layer on its rank) was
    planned for the configured count, not more."""
    if not 0 <= num_redundant_experts <= config.num_redundant_experts:
        raise ValueError(
            f"num_redundant_experts: {num_redundant_experts} is outside [0, {config.num_redundant_experts}] "
            "(ffn.eplb.num_redundant_experts, the redundant slots the deployment is sized for)"
        )


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 1.0
