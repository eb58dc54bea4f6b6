"""The offline simulator: run a policy over a recorded trace or a synthetic load ramp,
with the same `decide` the live controller calls.

- `replay`: open loop. The recorded signals do not react to the decisions; it shows
  what the policy would have asked for, evaluation by evaluation.
- `simulate_ramp`: closed loop over `RampWorkload`, a fluid model of an AFD
  deployment under a request-rate ramp; pool sizes follow the decisions (new ranks
  after `resize_delay_s`), and the signals follow the pool sizes.
- `plot`: a PNG of load, pool sizes (live and target) and the SLO signals.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from afd_ray.autoscale.policy import decide, signal_values
from afd_ray.autoscale.schema import AutoscalePolicy, Decision, MetricsSnapshot, ScaleState

__all__ = ["RampWorkload", "Step", "changes", "plot", "replay", "simulate_ramp"]


@dataclass(frozen=True)
class Step:
    """One evaluation: what the policy saw and what it decided."""

    snapshot: MetricsSnapshot
    decision: Decision


def replay(trace: list[MetricsSnapshot], policy: AutoscalePolicy) -> list[Step]:
    """`decide` over every snapshot of `trace`, starting from the first snapshot's
    pool sizes and carrying the state."""
    state = ScaleState.initial(trace[0].attention_ranks, trace[0].ffn_ranks)
    steps = []
    for snapshot in trace:
        decision = decide(snapshot, state, policy)
        steps.append(Step(snapshot, decision))
        state = decision.state
    return steps


class RampWorkload(BaseModel):
    """A request-rate ramp and a fluid model of the deployment serving it.

    Request rate: `base_rps` until `rise_at_s`, linear up to `peak_rps` over `rise_s`,
    held for `hold_s`, linear down to `base_rps` over `fall_s`, then `base_rps` until
    `duration_s`. Every request has `prompt_tokens` and `output_tokens`.

    Per tick of `tick_s`, with A attention and F FFN ranks live and R requests running
    (Little's-law fluid model, no randomness):

    - admission: waiting requests start while R < A x `max_num_seqs`;
    - a decode step runs attention, then FFN, layer after layer (no overlap), so
      TPOT = `base_tpot_s` + (R / A) / `attention_tokens_per_s` + (R / F) / `ffn_tokens_per_s`;
      throughput = R / TPOT;
    - requests finish at throughput / `output_tokens` per second;
    - KV-cache usage = R x (`prompt_tokens` + `output_tokens` / 2) / (A x `kv_tokens_per_rank`);
    - TTFT = `prefill_s` + waiting / admission rate (time to drain the queue ahead);
    - FFN busy fraction = FFN share of TPOT; tokens per FFN step = R / F.

    Defaults are of the order of SmolLM2-135M on the 2-core CPU default (about 50 tok/s
    at 1A:1F with a full batch), with the peak needing 2A:2F.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    duration_s: float = Field(900.0, gt=0)
    tick_s: float = Field(1.0, gt=0)
    """Time between policy evaluations, seconds."""
    base_rps: float = Field(0.1, ge=0)
    peak_rps: float = Field(1.5, ge=0)
    rise_at_s: float = Field(60.0, ge=0)
    rise_s: float = Field(60.0, ge=0)
    hold_s: float = Field(300.0, ge=0)
    fall_s: float = Field(60.0, ge=0)
    prompt_tokens: int = Field(64, ge=1)
    output_tokens: int = Field(64, ge=1)
    max_num_seqs: int = Field(16, ge=1)
    """Requests one attention rank decodes at once."""
    attention_tokens_per_s: float = Field(120.0, gt=0)
    """Token rows per second of attention compute of one attention rank."""
    ffn_tokens_per_s: float = Field(140.0, gt=0)
    """Token rows per second of FFN compute of one FFN rank."""
    kv_tokens_per_rank: float = Field(23000.0, gt=0)
    """KV-cache capacity of one attention rank in tokens (1 GiB of SmolLM2-135M float32)."""
    base_tpot_s: float = Field(0.05, gt=0)
    """Time per output token of a lone request, seconds."""
    prefill_s: float = Field(0.2, ge=0)
    """Prefill time of one prompt, seconds."""
    resize_delay_s: float = Field(45.0, ge=0)
    """Time from a scale-out decision until the new ranks serve, seconds; scale-in
    takes effect at once."""

    def rps(self, t: float) -> float:
        """Request rate at time `t`, requests/s."""
        span = self.peak_rps - self.base_rps
        rise_end = self.rise_at_s + self.rise_s
        fall_at = rise_end + self.hold_s
        if t < self.rise_at_s or t >= fall_at + self.fall_s:
            return self.base_rps
        if t < rise_end:
            return self.base_rps + span * (t - self.rise_at_s) / max(self.rise_s, 1e-9)
        if t < fall_at:
            return self.peak_rps
        return self.peak_rps - span * (t - fall_at) / max(self.fall_s, 1e-9)


def simulate_ramp(workload: RampWorkload, policy: AutoscalePolicy) -> list[Step]:
    """Closed-loop run of `policy` over `workload` from `policy`'s minimum sizes,
    one evaluation per `workload.tick_s` (times start at 0)."""
    w = workload
    live = {"attention": policy.attention.min_ranks, "ffn": policy.ffn.min_ranks}
    ready_at: dict[str, tuple[float, int]] = {}
    state = ScaleState.initial(live["attention"], live["ffn"])
    waiting = running = 0.0
    steps = []
    t = 0.0
    while t <= w.duration_s:
        for pool, (when, target) in list(ready_at.items()):
            if t >= when:
                live[pool] = target
                del ready_at[pool]
        a, f = live["attention"], live["ffn"]
        waiting += w.rps(t) * w.tick_s
        admitted = min(waiting, max(a * w.max_num_seqs - running, 0.0))
        waiting -= admitted
        running += admitted
        attention_s = running / a / w.attention_tokens_per_s  # attention share of one decode step
        ffn_s = running / f / w.ffn_tokens_per_s  # FFN share of one decode step
        tpot = w.base_tpot_s + attention_s + ffn_s
        throughput = running / tpot
        finished = min(running, throughput / w.output_tokens * w.tick_s)
        running -= finished
        admit_rate = max(finished / w.tick_s, 1e-9)
        snapshot = MetricsSnapshot(
            time_s=t,
            attention_ranks=a,
            ffn_ranks=f,
            kv_cache_usage=min(running * (w.prompt_tokens + w.output_tokens / 2) / (a * w.kv_tokens_per_rank), 1.0),
            waiting_requests=waiting,
            running_requests=running,
            ttft_p90_s=w.prefill_s + waiting / admit_rate if admitted or waiting else 0.0,
            tpot_p90_s=tpot if running else 0.0,
            ffn_busy_fraction=ffn_s / tpot,
            tokens_per_ffn_step=running / f,
            output_tokens_per_s=throughput,
        )
        decision = decide(snapshot, state, policy)
        for pool, target in (("attention", decision.attention_target), ("ffn", decision.ffn_target)):
            if target > live[pool] and ready_at.get(pool, (0, 0))[1] != target:
                ready_at[pool] = (t + w.resize_delay_s, target)
            elif target < live[pool]:
                live[pool] = target
                ready_at.pop(pool, None)
        steps.append(Step(snapshot, decision))
        state = decision.state
        t += w.tick_s
    return steps


def changes(steps: list[Step]) -> list[Step]:
    """The steps whose decision changed a target from the previous step's."""
    out = []
    prev = (steps[0].snapshot.attention_ranks, steps[0].snapshot.ffn_ranks) if steps else (0, 0)
    for step in steps:
        now = (step.decision.attention_target, step.decision.ffn_target)
        if now != prev:
            out.append(step)
        prev = now
    return out


def plot(steps: list[Step], path: Path, title: str) -> None:
    """Write a PNG of `steps` to `path`, five panels over time: load (output tokens/s;
    running and waiting requests), pool sizes (live ranks solid, policy targets dashed),
    latency SLO signals (TTFT p90, TPOT p90, seconds), fractions (KV-cache usage, FFN
    busy) and counts (waiting and running requests per attention rank, tokens per FFN
    step): every signal a policy can name, as `decide` computes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = steps[0].snapshot.time_s
    t = [s.snapshot.time_s - t0 for s in steps]

    def series(name: str) -> list[float]:
        return [getattr(s.snapshot, name) for s in steps]

    fig, (load, pools, latency, fractions, counts) = plt.subplots(5, 1, figsize=(10, 12), sharex=True)
    fig.suptitle(title)
    load.plot(t, series("output_tokens_per_s"), label="output tokens/s")
    load.set_ylabel("tokens/s")
    load.legend(loc="upper left")
    requests = load.twinx()
    requests.plot(t, series("running_requests"), color="tab:green", label="running requests")
    requests.plot(t, series("waiting_requests"), color="tab:red", label="waiting requests")
    requests.set_ylabel("requests")
    requests.legend(loc="upper right")

    for name, color, target in (
        ("attention", "tab:blue", [s.decision.attention_target for s in steps]),
        ("ffn", "tab:orange", [s.decision.ffn_target for s in steps]),
    ):
        pools.step(t, series(f"{name}_ranks"), where="post", color=color, label=f"{name} live")
        pools.step(t, target, "--", where="post", color=color, label=f"{name} target")
    pools.set_ylabel("ranks")
    pools.legend(loc="upper left")

    values = [signal_values(s.snapshot) for s in steps]
    for axis, unit, names in (
        (latency, "seconds", ("ttft_p90_s", "tpot_p90_s")),
        (fractions, "fraction", ("kv_cache_usage", "ffn_busy_fraction")),
        (counts, "count", ("waiting_per_rank", "running_per_rank", "tokens_per_ffn_step")),
    ):
        for name in names:
            axis.plot(t, [v[name] for v in values], label=name)
        axis.set_ylabel(unit)
        axis.legend(loc="upper left")
    counts.set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
