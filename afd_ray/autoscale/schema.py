"""The autoscaling schema: what the policy reads and carries, as pydantic models.

- `MetricsSnapshot`: the signals at one evaluation (live: `afd_ray.observability.signals`;
  offline: a recorded trace or the simulator's workload model).
- `AutoscalePolicy`: the policy YAML (`deployments/autoscale.yaml`), its parts taken
  strictly (loaded by `afd_ray.autoscale.loader`).
- `ScaleState` / `PoolState`: what `afd_ray.autoscale.policy.decide` carries between
  evaluations; `Decision`: its answer.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = [
    "AttentionPoolPolicy",
    "AttentionSignals",
    "AutoscalePolicy",
    "Decision",
    "FFNPoolPolicy",
    "FFNSignals",
    "MetricsSnapshot",
    "PoolState",
    "ScaleState",
    "Thresholds",
]


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
            raise ValueError(f"scale_in ({self.scale_in}) must be below scale_out ({self.scale_out}) (hysteresis)")
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
