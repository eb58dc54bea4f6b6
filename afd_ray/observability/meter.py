"""The FFN loop's accounting: counters, per-step timing records, expert load, step split.

Expert load (EPLB, docs/eplb.md): besides the cumulative rows per expert
(`expert_tokens`), a sliding window of the last `window_size` steps' routed rows per
(MoE layer, expert), vLLM's `expert_load_window`: a `[W, L, E]` int64 ring on the
model's device whose slot of the current step is cleared when it begins.

`StepMeter` is what the FFN loop (`afd_ray.ffn.runtime`) records into, one step at a
time: `begin` opens a `StepTally`, the loop marks each layer's ubatch on it (rows
arrived, computed, sent), and `end` closes it into one `FFNStep` record
(`afd_ray.observability.steps`) and new `FFNStats` counters. The FFN server reads the
counters, records and expert load from its own thread for metrics and reports.

Times: `FFNStep` holds host times (`time.perf_counter`), which on CUDA are the times of
asynchronous launches. With EP, the step agreement all-reduce comes before `begin`, so
it counts as batching-window wait (`PeerStep.queue_s`).

Step split (`FFNStats.split`, `afd_ray.observability.timeline`): per layer and ubatch
the tally stamps when the rows arrived, when compute ended and when the F2A sends
ended, on the device timeline (CUDA events on the loop's stream; `time.perf_counter`
on CPU). Every step is timed on CPU, one in `timeline.CUDA_SAMPLE_EVERY` on CUDA;
events are read back once complete, never with a host sync (`settle` counts the ones
completed while the loop idles). A step that starts more than `timeline.IDLE_GAP_S`
after the previous one ended (host time), and the first after `rest()` (a layout
switch, an EP failure), are not timed: their interval is the service idle or a
rebuild, not a step.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from afd_ray.observability.stats import FFNStats
from afd_ray.observability.steps import FFNStep, PeerStep, StepRing
from afd_ray.observability.timeline import Marker, StepTimeline

__all__ = ["StepMeter", "StepTally"]


class StepTally:
    """One FFN step's measurements while it runs; made by `StepMeter.begin`.

    Per layer and ubatch, in this order: `arrived()` once the A2F receives are done,
    `computed(ids)` once compute is queued or done, `sent(nbytes)` once the F2A sends
    are done.
    """

    def __init__(self, meter: StepMeter, collective_s: float) -> None:
        self.start = time.perf_counter()
        """Host time the step started (`time.perf_counter()`), before its compute was built."""
        self.wall = time.time()
        self.collective_s = collective_s
        """The EP group's `collective_s` at the start, seconds (0 without EP)."""
        self.compute_s = 0.0
        self.f2a_s = 0.0
        self.f2a_bytes = 0
        """Bytes sent back (`[T_i, H]` or `[T_i, P, H]` per peer and layer)."""
        self.marks: list[Marker] | None = meter.timeline.begin(self.start)
        """Device-timeline stamps (arrived, computed, sent per layer and ubatch) of a timed
        step; None: the step is not timed."""
        self._meter = meter
        self._expert_tokens = meter.expert_tokens
        self._window = meter.load_window[meter.window_slot].view(-1) if meter.load_window is not None else None
        """This step's `[L*E]` slot of the load window (None: a dense model)."""
        self._num_experts = meter.num_experts
        self._clock = meter.timeline.clock
        self._at = self.start

    def _stamp(self) -> None:
        if self.marks is not None:
            self.marks.append(self._clock.stamp())

    def arrived(self) -> None:
        """The ubatch's rows of this layer are in; its compute starts now."""
        self._stamp()
        self._at = time.perf_counter()

    def computed(self, ids: torch.Tensor | None, moe_layer: int | None = None) -> None:
        """The layer's compute of the ubatch ended; count its routed experts.

        Args:
            ids: `[rows, k]` int64 experts each real row was routed to (an MoE layer,
                padding rows left out), on the model's device; None for a dense layer.
            moe_layer: the MoE layer's index among the model's MoE layers (its row of
                the load window); None for a dense layer.
        """
        if ids is not None:
            ids = ids.flatten()  # [rows*k]
            ones = self._meter.ones(ids.numel())
            if self._window is not None and moe_layer is not None:  # `expert_tokens` from it at `end`
                self._window.index_add_(0, ids + moe_layer * self._num_experts, ones)
            else:
                self._expert_tokens.index_add_(0, ids, ones)
        self._stamp()
        now = time.perf_counter()
        self.compute_s += now - self._at
        self._at = now

    def sent(self, nbytes: int) -> None:
        """The ubatch's F2A sends of this layer ended, `nbytes` bytes in all."""
        self.f2a_bytes += nbytes
        self._stamp()
        self.f2a_s += time.perf_counter() - self._at


class StepMeter:
    """The counters, step records and expert load of one FFN loop (one thread writes;
    other threads read `stats`, `steps` and `expert_tokens`).

    Args:
        device: the model's device (the timeline's clock and `expert_tokens` live there).
        num_experts: routed experts per MoE layer (0: a dense model).
        records: FFN steps kept in `steps` (a ring buffer).
        moe_layers: MoE layers of the model (0: a dense model, no load window).
        window_size: steps in the load window (`ffn.eplb.window_size`).
    """

    def __init__(
        self, device: torch.device, num_experts: int, records: int, moe_layers: int = 0, window_size: int = 1000
    ) -> None:
        self.stats = FFNStats()
        """Counters since start; replaced whole at each step's end, so a snapshot read
        from another thread is consistent."""
        self.steps: StepRing[FFNStep] = StepRing(records)
        """The last `records` steps' timing records."""
        self.expert_tokens = torch.zeros(num_experts, dtype=torch.int64, device=device)
        """Rows this rank's tokens routed to each expert `[E]` int64, summed over MoE
        layers and steps (expert load; updated in place at each step's end, from the load
        window's slot, on the model's device; on CUDA a read from another thread does not
        wait for the steps in flight)."""
        self.timeline = StepTimeline.of(device)
        """Device-timeline stamps of timed steps: `FFNStats.split`."""
        self.num_experts = num_experts
        self.load_window = (
            torch.zeros(window_size, moe_layers, num_experts, dtype=torch.int64, device=device)
            if moe_layers and num_experts
            else None
        )
        """`[W, L, E]` int64: routed rows of this rank's tokens per (MoE layer, expert)
        in each of the last W steps (slot `steps % W`); None for a dense model."""
        self.window_slot = 0
        """The load window's slot of the step in progress (or of the next one)."""
        self._window_steps = 0
        self._epoch_steps = (0, 0)
        """(layout epoch, steps recorded in it): `FFNStep.index`."""
        self._ones = torch.ones(0, dtype=torch.int64, device=device)

    def ones(self, count: int) -> torch.Tensor:
        """`[count]` int64 ones on the model's device (a view of a kept tensor: the expert
        counts add them without a fill launch per layer)."""
        if self._ones.numel() < count:
            self._ones = torch.ones(max(count, 2 * self._ones.numel()), dtype=torch.int64, device=self._ones.device)
        return self._ones[:count]

    def begin(self, collective_s: float) -> StepTally:
        """Start a step now (it takes the next slot of the load window, cleared).

        Args:
            collective_s: the EP group's `collective_s` now, seconds (0 without EP).
        """
        if self.load_window is not None:
            self.window_slot = self._window_steps % self.load_window.shape[0]
            self._window_steps += 1
            self.load_window[self.window_slot].zero_()
        return StepTally(self, collective_s)

    def window_load(self) -> list[list[int]]:
        """Routed rows per (MoE layer, expert) `[L][E]` over the last `window_size`
        steps (fewer since start); empty for a dense model. From any thread: on CUDA it
        reads what the steps queued so far did, without waiting for the ones in flight."""
        if self.load_window is None:
            return []
        return self.load_window.sum(dim=0).tolist()

    def end(
        self,
        tally: StepTally,
        epoch: int,
        peers: tuple[PeerStep, ...],
        layers: int,
        a2f_bytes: int,
        collective_s: float,
    ) -> None:
        """Close the step of `tally`: append its `FFNStep` to `steps`, count it in `stats`.

        Args:
            epoch: the layout epoch the step ran in.
            peers: each attention peer's share of the step, in peer order.
            layers: FFN layers the step ran.
            a2f_bytes: bytes received over all layers (hidden states, and top-k ids and
                weights with `gate_on_attention`).
            collective_s: the EP group's `collective_s` now, seconds (0 without EP).
        """
        if self.load_window is not None:  # this step's routed rows, summed over its MoE layers
            self.expert_tokens += self.load_window[self.window_slot].sum(dim=0)
        self.timeline.end(tally.marks, time.perf_counter())
        end = time.perf_counter()
        ep_s = collective_s - tally.collective_s
        compute_s = max(tally.compute_s - ep_s, 0.0)
        index = self._epoch_steps[1] if self._epoch_steps[0] == epoch else 0
        self._epoch_steps = (epoch, index + 1)
        self.steps.append(FFNStep(epoch, tally.wall, peers, compute_s, ep_s, tally.f2a_s, end - tally.start, index))
        stats = self.stats
        self.stats = replace(
            stats,
            steps=stats.steps + 1,
            layers=stats.layers + layers,
            tokens=stats.tokens + sum(peer.num_tokens for peer in peers),
            busy_s=stats.busy_s + end - tally.start,
            a2f_bytes=stats.a2f_bytes + a2f_bytes,
            f2a_bytes=stats.f2a_bytes + tally.f2a_bytes,
            split=stats.split + self.timeline.collect(),
            compute_s=stats.compute_s + compute_s,
            ep_s=stats.ep_s + ep_s,
        )

    def rest(self) -> None:
        """The next step starts no timed interval (the layout changed or failed)."""
        self.timeline.rest()

    def settle(self) -> None:
        """Count the timed steps whose stamps completed since the last step (called
        while the loop idles)."""
        split = self.timeline.collect()
        if split.steps:
            self.stats = replace(self.stats, split=self.stats.split + split)
