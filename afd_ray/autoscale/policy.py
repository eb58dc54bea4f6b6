"""The A:F autoscaling policy: a pure function from a metrics snapshot, the carried
state and the policy YAML to the two pool targets and the reason.

`decide` has no side effects and reads no clock: the live controller (Serve's
application-level `autoscaling_policy`) and the simulator (`afd_ray.autoscale.simulate`)
run the same code on `MetricsSnapshot`s, so a policy tuned offline behaves the same
live.

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
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = [
    "AttentionPoolPolicy",
    "AttentionSignals",
    "AutoscalePolicy",
    "Decision",
    "FFNPoolPolicy",
    "FFNSignals",
    "MetricsSnapshot",
    "PolicyError",
    "PoolState",
    "ScaleState",
    "Thresholds",
    "decide",
    "load_policy",
    "parse_policy",
    "signal_values",
]

Pool = Literal["attention", "ffn"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class _PolicyPart(_Frozen):
    """A part of the YAML policy: values are taken strictly (`min_ranks: "2"` or
    `step: true` is refused, naming the field; an integer stays valid for a float)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class MetricsSnapshot(_Frozen):
    """What the policy sees at one evaluation: flat numbers only, so that it also
    travels as Serve's `record_autoscaling_stats()` `dict[str, float]`.

    Sources (`afd_ray.observability.signals.SignalAggregator`): the attention fields come
    from vLLM's own stats of each engine (`SchedulerStats`, `IterationStats`), the FFN
    fields from deltas of `afd_ray.observability.stats.FFNStats` over the window.
    """

    time_s: float
    """When the snapshot was taken, unix time in seconds."""
    attention_ranks: int = Field(ge=0)
    """Live attention ranks the attention fields cover."""
    ffn_ranks: int = Field(ge=0)
    """Live FFN ranks the FFN fields cover."""
    kv_cache_usage: float = Field(0.0, ge=0, le=1)
    """Fraction of KV-cache blocks in use, mean over attention ranks (vLLM
    `SchedulerStats.kv_cache_usage`)."""
    waiting_requests: float = Field(0.0, ge=0)
    """Requests admitted by the engines but not yet scheduled, summed over attention
    ranks (vLLM `SchedulerStats.num_waiting_reqs`)."""
    running_requests: float = Field(0.0, ge=0)
    """Requests being decoded, summed over attention ranks (`num_running_reqs`)."""
    ttft_p90_s: float = Field(0.0, ge=0)
    """90th percentile of time to first token over the window, seconds (vLLM
    `IterationStats.time_to_first_tokens_iter`, arrival to first token); 0 without
    samples."""
    tpot_p90_s: float = Field(0.0, ge=0)
    """90th percentile of time per output token of the requests finished in the
    window, seconds (vLLM `FinishedRequestStats.mean_time_per_output_token`:
    decode time / (output tokens - 1)); 0 without samples."""
    ffn_busy_fraction: float = Field(0.0, ge=0, le=1)
    """Fraction of wall time the FFN ranks spent inside steps over the window, mean over
    FFN ranks (Δ`FFNStats.busy_s` / Δt)."""
    tokens_per_ffn_step: float = Field(0.0, ge=0)
    """Token rows per FFN step over the window: Σ Δ`FFNStats.tokens` / Σ Δ`FFNStats.steps`
    over FFN ranks; 0 without steps."""
    output_tokens_per_s: float = Field(0.0, ge=0)
    """Generated tokens per second over the window, all attention ranks (the load)."""

    def to_serve_metrics(self) -> dict[str, float]:
        """Every field as a float, the shape Serve's `record_autoscaling_stats()` returns."""
        return {name: float(value) for name, value in self.model_dump().items()}

    @classmethod
    def from_serve_metrics(cls, metrics: Mapping[str, float]) -> MetricsSnapshot:
        """The inverse of `to_serve_metrics` (rank counts are rounded back to int).

        Raises:
            pydantic.ValidationError: a field is missing, unknown or out of range.
        """
        values = dict(metrics)
        for name in ("attention_ranks", "ffn_ranks"):
            if name in values:
                values[name] = round(values[name])
        return cls.model_validate(values)


class Thresholds(_PolicyPart):
    """The hysteresis band of one signal: scale out above `scale_out`, scale in below
    `scale_in`, hold in between."""

    scale_out: float = Field(ge=0)
    """Above this value (held for the pool's `scale_out_after_s`) the pool grows."""
    scale_in: float = Field(ge=0)
    """Below this value (held for `scale_in_after_s`, with every other signal also
    below its own) the pool shrinks; must be below `scale_out`."""

    @model_validator(mode="after")
    def _band(self) -> Thresholds:
        if self.scale_in >= self.scale_out:
            raise ValueError(
                f"scale_in ({self.scale_in}) must be below scale_out ({self.scale_out}) (hysteresis)"
            )
        return self


class _FractionThresholds(Thresholds):
    """Thresholds of a signal that is a fraction in [0, 1]."""

    scale_out: float = Field(ge=0, le=1)
    scale_in: float = Field(ge=0, le=1)


class _Signals(_PolicyPart):
    def bands(self) -> dict[str, Thresholds]:
        """The configured signals by name (unset ones left out)."""
        return {name: band for name, band in self if band is not None}


class AttentionSignals(_Signals):
    """Signals of the attention pool; leave one out (null) to ignore it."""

    kv_cache_usage: _FractionThresholds | None = None
    """On `MetricsSnapshot.kv_cache_usage`, a fraction in [0, 1]."""
    waiting_per_rank: Thresholds | None = None
    """On `waiting_requests / attention_ranks`, requests."""
    running_per_rank: Thresholds | None = None
    """On `running_requests / attention_ranks`, requests (batch occupancy; compare
    with `attention.max_num_seqs`). The load signal that keeps a busy pool from
    shrinking when the KV cache is large and nothing waits."""
    ttft_p90_s: Thresholds | None = None
    """On `MetricsSnapshot.ttft_p90_s`, seconds."""


class FFNSignals(_Signals):
    """Signals of the FFN pool; leave one out (null) to ignore it."""

    ffn_busy_fraction: _FractionThresholds | None = None
    """On `MetricsSnapshot.ffn_busy_fraction`, a fraction in [0, 1]."""
    tpot_p90_s: Thresholds | None = None
    """On `MetricsSnapshot.tpot_p90_s`, seconds."""
    tokens_per_ffn_step: Thresholds | None = None
    """On `MetricsSnapshot.tokens_per_ffn_step`, token rows."""


class _PoolPolicy(_PolicyPart):
    min_ranks: int = Field(1, ge=1)
    """Fewest ranks the policy asks for."""
    max_ranks: int = Field(1, ge=1)
    """Most ranks the policy asks for; at least `min_ranks`."""
    step: int = Field(1, ge=1)
    """Ranks added or removed by one decision (clamped to the bounds)."""
    scale_out_after_s: float = Field(0.0, ge=0)
    """How long a signal must stay above `scale_out` before the pool grows, seconds
    (Serve's `upscale_delay_s`)."""
    scale_in_after_s: float = Field(0.0, ge=0)
    """How long every signal must stay below `scale_in` before the pool shrinks,
    seconds (Serve's `downscale_delay_s`)."""
    scale_out_cooldown_s: float = Field(0.0, ge=0)
    """After any change of this pool, no scale-out for this long, seconds; set it to
    at least the time a new rank takes to start."""
    scale_in_cooldown_s: float = Field(0.0, ge=0)
    """After any change of this pool, no scale-in for this long, seconds."""

    @model_validator(mode="after")
    def _bounds(self) -> _PoolPolicy:
        if self.min_ranks > self.max_ranks:
            raise ValueError(f"min_ranks ({self.min_ranks}) must not exceed max_ranks ({self.max_ranks})")
        return self


class AttentionPoolPolicy(_PoolPolicy):
    """Scaling of the attention pool (vLLM engines with the KV cache)."""

    signals: AttentionSignals = AttentionSignals()


class FFNPoolPolicy(_PoolPolicy):
    """Scaling of the FFN pool (stateless FFN/expert ranks)."""

    signals: FFNSignals = FFNSignals()


class AutoscalePolicy(_PolicyPart):
    """Root of the policy YAML (`deployments/autoscale.yaml`)."""

    attention: AttentionPoolPolicy = AttentionPoolPolicy()
    ffn: FFNPoolPolicy = FFNPoolPolicy()


class PoolState(_Frozen):
    """What the policy carries for one pool between evaluations (unix times, s)."""

    target: int = Field(ge=0)
    """The last decided number of ranks."""
    above_since_s: float | None = None
    """Since when some signal has been above its `scale_out`; None if none is now."""
    below_since_s: float | None = None
    """Since when every signal has been below its `scale_in`; None if one is not now."""
    last_change_s: float | None = None
    """When the target last changed; None if never (no cooldown)."""


class ScaleState(_Frozen):
    """The policy's state; JSON round-trips through `model_dump()` / `model_validate()`
    (Serve's `policy_state`)."""

    attention: PoolState
    ffn: PoolState

    @classmethod
    def initial(cls, attention_ranks: int, ffn_ranks: int) -> ScaleState:
        """The state before the first evaluation: targets are the current sizes."""
        return cls(attention=PoolState(target=attention_ranks), ffn=PoolState(target=ffn_ranks))

    def follow(self, attention_ranks: int, ffn_ranks: int, now: float) -> ScaleState:
        """This state after a change the policy did not decide (a manual resize, or a
        resize that ended elsewhere than asked): a pool whose target differs from its
        actual size takes that size, as a change at `now` (timers reset, cooldowns
        start); a pool already there is unchanged."""

        def pool(state: PoolState, size: int) -> PoolState:
            return state if state.target == size else PoolState(target=size, last_change_s=now)

        return ScaleState(attention=pool(self.attention, attention_ranks), ffn=pool(self.ffn, ffn_ranks))


class Decision(_Frozen):
    """The policy's answer at one evaluation."""

    attention_target: int
    ffn_target: int
    attention_reason: str
    """Why, naming the deciding signal and value, e.g.
    `attention +1 (1 -> 2): kv_cache_usage 0.93 > 0.85 for 30 s`."""
    ffn_reason: str
    attention_cause: str
    """What decided, as a bounded label (the `reason` label of `afd_autoscale_decisions`):
    the signal above its `scale_out` band that drove the decision (e.g. `kv_cache_usage`),
    `all_below` (every signal under its `scale_in` band), `bounds` (the target was
    clamped to `[min_ranks, max_ranks]`), `in_band` (hysteresis: hold) or `no_signals`."""
    ffn_cause: str
    """The FFN pool's cause, as `attention_cause`."""
    state: ScaleState
    """Pass to the next `decide`."""

    @property
    def reason(self) -> str:
        return f"{self.attention_reason}; {self.ffn_reason}"


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


def _field(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as a dotted field path (`attention.min_ranks`)."""
    return ".".join(str(part) for part in loc) or "<root>"


def load_policy(path: str | Path) -> AutoscalePolicy:
    """Read and validate a policy YAML file.

    Raises:
        ValueError: the file is not UTF-8 YAML, or does not fit `AutoscalePolicy`;
            the message names the file and each bad field as a dotted path, e.g.
            `autoscale.yaml: attention.scale_in_cooldown_s: Input should be greater
            than or equal to 0`. Cross-field errors name both fields, e.g.
            `attention: min_ranks (3) must not exceed max_ranks (2)`.
        OSError: the file cannot be read.
    """
    path = Path(path)
    try:
        text = path.read_bytes().decode()
    except UnicodeDecodeError as e:
        raise PolicyError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); a policy is a YAML file") from e
    return parse_policy(text, str(path))


class PolicyError(ValueError):
    """A policy document that is not YAML or does not fit `AutoscalePolicy`."""

    def __init__(self, message: str, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fields = fields
        """Dotted paths of the bad fields (e.g. `attention.min_ranks`); empty when the
        text is not YAML."""


def parse_policy(text: str, source: str = "policy") -> AutoscalePolicy:
    """Validate a policy given as YAML (or JSON) text, e.g. the body of `POST
    /afd/autoscale/policy`.

    Raises:
        PolicyError: as `load_policy`'s `ValueError`, the message starting with `source`.
    """
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise PolicyError(f"{source}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        got = "an empty document" if data is None else f"a {type(data).__name__}"
        raise PolicyError(
            f"{source}: expected a YAML mapping with an `attention` and/or an `ffn` section "
            f"(e.g. deployments/autoscale.yaml), got {got}"
        )
    try:
        return AutoscalePolicy.model_validate(data)
    except ValidationError as e:
        fields = tuple(_field(err["loc"]) for err in e.errors())
        problems = "; ".join(
            f"{field}: {err['msg'].removeprefix('Value error, ')}" for field, err in zip(fields, e.errors(), strict=True)
        )
        raise PolicyError(f"{source}: {problems}", fields) from e
