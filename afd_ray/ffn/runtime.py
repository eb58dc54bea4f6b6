"""The FFN runtime: a loop driven by the connector, with no scheduler and no KV cache.

The runtime talks to its peers only through the connector contract (`FFNLink`,
`afd_ray.connector.link`), whatever the transport of each pair. Each iteration:

1. form: `StepFormer` reads headers into one `FormedStep` (`afd_ray.ffn.step_former`);
2. agree: with EP, every rank of the group agrees on the step (`EPGroup.agree`);
3. run the layers: per FFN layer from the step's `first_layer`, receive `[T_i, H]`
   from each peer (A2F), compute on all rows at once, send each peer its rows (F2A);
4. record: the step's timing record and counters (`afd_ray.observability.meter`);
   then the step boundary: JOIN/LEAVE, dropped peers, a layout switch
   (`afd_ray.ffn.layout`).

The loop owns nothing across steps except the weights and its counters, so a lost
FFN rank loses no request data.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace

import torch

from afd_ray.connector.link import FFNLink
from afd_ray.ffn.ep import EPGroup
from afd_ray.ffn.graphs import DEFAULT_BUCKETS
from afd_ray.ffn.layout import Layout
from afd_ray.ffn.model import FFNStack
from afd_ray.ffn.step_former import FormedStep, StepFormer
from afd_ray.ffn.ubatch import Ubatch
from afd_ray.observability.device_trace import DeviceTrace
from afd_ray.observability.meter import StepMeter
from afd_ray.observability.stats import FFNStats
from afd_ray.observability.steps import FFNStep, StepRing

__all__ = ["FFNRuntime"]


class FFNRuntime:
    """Serves the FFN half of every layer to the attention peers of one `FFNLink`.

    With an EP group (F > 1 FFN ranks) every FFN rank runs every step (lockstep,
    `afd_ray.ffn.ep`), with no local rows if need be, whenever any rank has tokens;
    every EP rank pads its rows to the same count (`EPGroup.moe`). An attention peer
    lost inside a step gets nothing more; the step runs to its end for the others
    (its rows zeroed) and its pair is closed at the boundary.

    Stream (CUDA): the loop queues its receives, compute and sends on a non-blocking
    stream of its own, never on the legacy default stream, which waits for (and is
    waited on by) every blocking stream's work: a pair opened at a step boundary
    (`afd_ray.connector.cuda_ipc`) must not queue behind the device-side flag waits of
    the steps in flight, nor they behind its setup.

    Args:
        model: the FFN blocks of every layer (an EP shard of the experts with EP),
            on its device, in the model dtype.
        channel: the FFN side of the connector (any transport).
        dtype: dtype of the A2F/F2A tensors (the model dtype).
        poll_s: longest wait for a header before the stop flag is checked (and, with
            EP, before an idle rank checks in with its group), seconds.
        batch_window_s: longest wait for more peers once one peer's STEP header
            arrived, seconds.
        ep: the EP group among FFN ranks, or None for a single FFN rank.
        epoch: the layout epoch this rank starts in.
        graph_buckets: padded token counts per FFN rank captured as CUDA graphs.
        step_records: FFN steps kept in `meter.steps` (a ring buffer).
        ep_lost_wait_s: how long a rank whose EP group failed waits for the re-formed
            layout (`Layout.prepare_switch`) before its loop ends, seconds.
        idle_poll_s: the longest header wait after idle rounds (doubling from
            `poll_s`), seconds; None: `poll_s`. It also bounds how long `stop()` takes.
        ubatches: DBO across attention ranks: a step's peers are served in up to this
            many groups (ubatches) per layer, one after the other, so that one group's
            attention runs while this rank computes another's (`FFNPoolConfig.ubatches`).
            With EP a step runs as one ubatch.
        load_window: FFN steps of expert load kept per (MoE layer, expert)
            (`ffn.eplb.window_size`, `StepMeter.window_load`).

    Raises:
        ValueError: `ubatches` < 1.
    """

    def __init__(
        self,
        model: FFNStack,
        channel: FFNLink,
        dtype: torch.dtype,
        poll_s: float,
        batch_window_s: float,
        ep: EPGroup | None = None,
        epoch: int = 0,
        graph_buckets: Sequence[int] = DEFAULT_BUCKETS,
        step_records: int = 4096,
        ep_lost_wait_s: float = 120.0,
        idle_poll_s: float | None = None,
        ubatches: int = 1,
        load_window: int = 1000,
    ) -> None:
        if ubatches < 1:
            raise ValueError(f"ubatches: {ubatches} < 1")
        device = next(model.parameters()).device
        moe = model.moe_blocks
        self.channel = channel
        num_experts = moe[0].spec.num_experts if moe else 0
        self.meter = StepMeter(device, num_experts, step_records, len(moe), load_window)
        """Counters, step records and expert load, read by the FFN server."""
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        """The loop's non-blocking CUDA stream (None on CPU)."""
        self.layout = Layout(
            model, ep, epoch, channel, dtype, graph_buckets, ubatches, ep_lost_wait_s, self._stream, self.meter.rest
        )
        """The layout served and its changes (thread-safe: `prepare_switch`, `drop_peers`, `take_pause`)."""
        self.former = StepFormer(channel, batch_window_s, poll_s, idle_poll_s)
        self.trace = DeviceTrace(device)
        """A profiler trace of the next steps, off until requested (`DeviceTrace.request`,
        from any thread); the loop starts and stops it at its step boundaries."""
        self._dtype = dtype
        self._ubatches = ubatches
        self._stop = threading.Event()

    @property
    def model(self) -> FFNStack:
        """The FFN blocks of the layout served now."""
        return self.layout.model

    @property
    def stats(self) -> FFNStats:
        """Counters since start (`StepMeter.stats`; a consistent snapshot)."""
        return self.meter.stats

    @property
    def steps(self) -> StepRing[FFNStep]:
        """The last `step_records` steps' timing records (`StepMeter.steps`)."""
        return self.meter.steps

    def stop(self) -> None:
        """Ask `run()` to return within one poll interval."""
        self._stop.set()

    def run(self) -> None:
        """Serve headers until `stop()`; then close the channel and the EP groups (the
        serving one and a prepared one), so that the other EP ranks' collectives fail
        at once instead of waiting out their timeout for a rank that is gone (same
        thread). On CUDA everything is queued on the loop's own stream, which first
        waits for the tensors other threads made (weights, `expert_tokens`) on the
        default stream.

        Raises:
            RuntimeError: the EP group failed and no new layout was handed over within
                `ep_lost_wait_s` (the coordinator then finds this rank's loop stopped).
        """
        if self._stream is None:
            self._serve()
            return
        self._stream.wait_stream(torch.cuda.default_stream(self._stream.device))
        with torch.cuda.stream(self._stream):
            self._serve()

    def _serve(self) -> None:
        """The loop of `run()`: form -> agree -> run the layers and record -> step boundary."""
        layout, former = self.layout, self.former
        try:
            while not self._stop.is_set():
                if layout.ep_lost and not layout.await_layout(self._stop):
                    continue
                step = former.next()
                prepared = layout.prepared
                if layout.ep is None:
                    switch = prepared is not None
                    lost = self._run(step, step.first_layer) if step.steps and not layout.left else set()
                else:  # an EP rank with no local step still runs the group's layers
                    switch, lost = self._agree_and_run(layout.ep, step, prepared is not None)
                changed = layout.boundary(step.membership, lost, prepared if switch else None)
                group_stepped = layout.ep is not None and any(layout.ep.step_tokens)
                active = bool(step.steps) or changed or prepared is not None or group_stepped
                former.pace(active)
                self.trace.tick(bool(step.steps) or group_stepped)
                if not active:
                    self.meter.settle()  # a timed step's events completed meanwhile
        finally:
            self.trace.close()
            self.channel.close()
            layout.close()

    def _agree_and_run(self, ep: EPGroup, step: FormedStep, ready: bool) -> tuple[bool, set[int]]:
        """Agree on the next step with the EP group and run it; returns whether the
        group switches layout after it, and the attention peers lost during it. A step
        of this rank that starts at another layer than the group's is held for a later
        agreement. A failed collective loses the EP group (`Layout.lose_ep`)."""
        try:
            run_step = ep.agree(step.tokens, ready, step.first_layer) > 0
            if step.steps and ep.step_tokens[ep.rank] == 0:
                self.former.hold(step)
                step = replace(step, steps=())
            lost = self._run(step, ep.first_layer) if run_step and not self.layout.left else set()
            return ep.all_ready, lost
        except RuntimeError as exc:  # PeerLostError of an attention peer is handled in _run
            self.former.reset()
            self.layout.lose_ep(exc)
            return False, set()

    def _run(self, step: FormedStep, first_layer: int) -> set[int]:
        """`_run_step`, a span of the device trace while one is recorded (`DeviceTrace.step`)."""
        with self.trace.step():
            return self._run_step(step, first_layer)

    @torch.inference_mode()
    def _run_step(self, step: FormedStep, first_layer: int) -> set[int]:
        """Run the layers from `first_layer` for `step` and record it; returns the
        attention peers lost on the way. A lost peer's rows are zeroed and it gets
        nothing more, but the step runs to its end: with EP the other ranks wait for
        this one in every layer.

        Raises:
            RuntimeError: an EP collective failed (not a `PeerLostError`).
        """
        ep, model = self.layout.ep, self.layout.model
        tally = self.meter.begin(ep.collective_s if ep is not None else 0.0)
        compute = self.layout.compute()
        padded = max(ep.step_tokens) if ep is not None else None
        ubatches = [Ubatch.of(compute, peers, padded) for peers in step.ubatches(self._ubatches if ep is None else 1)]
        layers = range(first_layer, model.num_layers)
        lost: set[int] = set()
        for layer in layers:
            for ubatch in ubatches:
                ubatch.receive(self.channel, layer, lost)
                tally.arrived()
                out, routed = compute.run(layer, ubatch.inputs)  # [R, H] or [R, P, H]; [R, k] int64 for an MoE layer
                tally.computed(routed[: ubatch.rows] if routed is not None else None, model.moe_index[layer])
                tally.sent(ubatch.send(self.channel, out[: ubatch.rows], layer, lost))
        routing = ubatches[0].inputs.routing  # ids [R, k] int64, weights [R, k] float32
        row_bytes = model.hidden_size * self._dtype.itemsize  # one [H] row, one way
        row_bytes += sum(t.shape[1] * t.element_size() for t in routing) if routing is not None else 0
        a2f_bytes = step.tokens * row_bytes * len(layers)
        collective_s = ep.collective_s if ep is not None else 0.0
        self.meter.end(tally, self.layout.epoch, step.peer_steps(tally.start), len(layers), a2f_bytes, collective_s)
        return lost
