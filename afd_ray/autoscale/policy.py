"""The A:F autoscaling policy: `decide`, a pure function from a metrics snapshot, the
carried state and the policy (`afd_ray.autoscale.schema`) to the two pool targets and
the reason.

`decide` has no side effects and reads no clock: the live controller
(`afd_ray.control.autoscaler.Autoscaler`, a loop in the coordinator) and the simulator
(`afd_ray.autoscale.simulate`) run the same code on `MetricsSnapshot`s, so a policy
tuned offline behaves the same live.

Per pool, independently (the model is Ray Serve's default autoscaling policy,
`ray/serve/autoscaling_policy.py`, whose `upscale_delay_s` / `downscale_delay_s` make
a scale decision wait until it has held that long):

- scale out by `step` when ANY configured signal has been above its `scale_out`
  threshold for `scale_out_after_s` (Serve's `upscale_delay_s`);
- scale in by `step` when ALL configured signals have been below their `scale_in`
  threshold for `scale_in_after_s` (Serve's `downscale_delay_s`);
- hysteresis: every `scale_in` threshold is strictly below its `scale_out`, so a signal
  between the two resets both timers and nothing changes;
- cooldowns: after a change of the pool, no scale-out for `scale_out_cooldown_s` and no
  scale-in for `scale_in_cooldown_s`; a change also resets both timers, so the new size
  needs fresh evidence;
- targets stay within `[min_ranks, max_ranks]`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from afd_ray.autoscale.schema import (
    AttentionPoolPolicy,
    AutoscalePolicy,
    Decision,
    FFNPoolPolicy,
    MetricsSnapshot,
    PoolState,
    ScaleState,
)

__all__ = ["decide", "signal_values"]

Pool = Literal["attention", "ffn"]


def signal_values(snapshot: MetricsSnapshot) -> dict[str, float]:
    """Every signal a policy can name, keyed like `AttentionSignals` / `FFNSignals`."""
    return {
        "kv_cache_usage": snapshot.kv_cache_usage,
        "waiting_per_rank": snapshot.waiting_requests / max(snapshot.attention_ranks, 1),
        "running_per_rank": snapshot.running_requests / max(snapshot.attention_ranks, 1),
        "ttft_p90_s": snapshot.ttft_p90_s,
        "ffn_busy_fraction": snapshot.ffn_busy_fraction,
        "tpot_p90_s": snapshot.tpot_p90_s,
        "tokens_per_ffn_step": snapshot.tokens_per_ffn_step,
    }


def _decide_pool(
    name: Pool,
    policy: AttentionPoolPolicy | FFNPoolPolicy,
    state: PoolState,
    values: Mapping[str, float],
    now: float,
) -> tuple[PoolState, str, str]:
    """One pool's new state, reason and cause (see the module docstring for the rules
    and `Decision.attention_cause` for the causes)."""
    bands = policy.signals.bands()
    clamped = min(max(state.target, policy.min_ranks), policy.max_ranks)
    if clamped != state.target:
        new = PoolState(target=clamped, last_change_s=now)
        return new, f"{name} {state.target} -> {clamped}: clamped to [{policy.min_ranks}, {policy.max_ranks}]", "bounds"
    above = {s: values[s] for s, band in bands.items() if values[s] > band.scale_out}
    all_below = bool(bands) and all(values[s] < band.scale_in for s, band in bands.items())
    above_since = (state.above_since_s if state.above_since_s is not None else now) if above else None
    below_since = (state.below_since_s if state.below_since_s is not None else now) if all_below else None
    held = state.model_copy(update={"above_since_s": above_since, "below_since_s": below_since})
    since_change = now - state.last_change_s if state.last_change_s is not None else float("inf")
    target = state.target

    if above:
        signal, value = max(above.items(), key=lambda kv: kv[1] / max(bands[kv[0]].scale_out, 1e-12))
        why = f"{signal} {value:.3g} > {bands[signal].scale_out:.3g}"
        waited = now - above_since
        if target >= policy.max_ranks:
            return held, f"{name} hold at max {policy.max_ranks}: {why}", signal
        if waited < policy.scale_out_after_s:
            return held, f"{name} hold: {why} for {waited:.0f} of {policy.scale_out_after_s:.0f} s", signal
        if since_change < policy.scale_out_cooldown_s:
            return (
                held,
                f"{name} hold: {why}, cooldown {since_change:.0f} of {policy.scale_out_cooldown_s:.0f} s",
                signal,
            )
        new_target = min(target + policy.step, policy.max_ranks)
        return (
            PoolState(target=new_target, last_change_s=now),
            f"{name} +{new_target - target} ({target} -> {new_target}): {why} for {waited:.0f} s",
            signal,
        )
    if all_below:
        why = ", ".join(f"{s} {values[s]:.3g} < {band.scale_in:.3g}" for s, band in bands.items())
        waited = now - below_since
        if target <= policy.min_ranks:
            return held, f"{name} hold at min {policy.min_ranks}: {why}", "all_below"
        if waited < policy.scale_in_after_s:
            return held, f"{name} hold: {why} for {waited:.0f} of {policy.scale_in_after_s:.0f} s", "all_below"
        if since_change < policy.scale_in_cooldown_s:
            return (
                held,
                f"{name} hold: {why}, cooldown {since_change:.0f} of {policy.scale_in_cooldown_s:.0f} s",
                "all_below",
            )
        new_target = max(target - policy.step, policy.min_ranks)
        return (
            PoolState(target=new_target, last_change_s=now),
            f"{name} -{target - new_target} ({target} -> {new_target}): {why} for {waited:.0f} s",
            "all_below",
        )
    if not bands:
        return held, f"{name} hold at {target}: no signals configured", "no_signals"
    return held, f"{name} hold at {target}: signals within the hysteresis band", "in_band"


def decide(snapshot: MetricsSnapshot, state: ScaleState, policy: AutoscalePolicy) -> Decision:
    """The two pool targets for `snapshot`, with reasons and the state to carry.

    Pure: the result depends only on the arguments, and time is `snapshot.time_s`.
    Targets are based on `state` (the last decided targets), not on the snapshot's live
    rank counts, so a resize still in progress is not asked for twice; per-rank signals
    (`waiting_per_rank`, `running_per_rank`) divide by the live `snapshot.attention_ranks`.
    """
    values = signal_values(snapshot)
    attention, attention_reason, attention_cause = _decide_pool(
        "attention", policy.attention, state.attention, values, snapshot.time_s
    )
    ffn, ffn_reason, ffn_cause = _decide_pool("ffn", policy.ffn, state.ffn, values, snapshot.time_s)
    return Decision(
        attention_target=attention.target,
        ffn_target=ffn.target,
        attention_reason=attention_reason,
        ffn_reason=ffn_reason,
        attention_cause=attention_cause,
        ffn_cause=ffn_cause,
        state=ScaleState(attention=attention, ffn=ffn),
    )
