"""The pure A:F policy: scale out and back in on a ramp without flapping, delays,
cooldowns, step size and bounds (bad policy YAML: test_loader.py)."""

from __future__ import annotations

import itertools
from pathlib import Path

from afd_ray.autoscale.loader import load_policy
from afd_ray.autoscale.policy import decide
from afd_ray.autoscale.schema import AutoscalePolicy, MetricsSnapshot, ScaleState
from afd_ray.autoscale.simulate import RampWorkload, changes, simulate_ramp

POLICY = Path(__file__).parents[2] / "deployments" / "autoscale.yaml"


def _policy(**attention: object) -> AutoscalePolicy:
    """A policy whose attention pool scales on KV-cache usage only (0.8 out, 0.2 in)."""
    section = {"signals": {"kv_cache_usage": {"scale_out": 0.8, "scale_in": 0.2}}} | attention
    return AutoscalePolicy.model_validate({"attention": section})


def _run(policy: AutoscalePolicy, kv: list[float], start_ranks: int = 1) -> list[int]:
    """Attention targets, one evaluation per second, for the KV-usage series `kv`."""
    state = ScaleState.initial(start_ranks, 1)
    targets = []
    for t, usage in enumerate(kv):
        snapshot = MetricsSnapshot(
            time_s=1000.0 + t, attention_ranks=state.attention.target, ffn_ranks=1, kv_cache_usage=usage
        )
        decision = decide(snapshot, state, policy)
        targets.append(decision.attention_target)
        state = decision.state
    return targets


def _reversals(targets: list[int]) -> int:
    """Times the direction of change flips (up then down counts once)."""
    moves = [b - a for a, b in itertools.pairwise(targets) if b != a]
    return sum(1 for x, y in itertools.pairwise(moves) if (x > 0) != (y > 0))


def test_ramp_from_yaml_scales_out_and_back_in_without_flapping() -> None:
    steps = simulate_ramp(RampWorkload(), load_policy(POLICY))
    for pool in ("attention", "ffn"):
        targets = [getattr(s.decision, f"{pool}_target") for s in steps]
        assert targets[0] == 1 and max(targets) == 2 and targets[-1] == 1, pool
        assert _reversals(targets) == 1, (pool, targets)
        ups = [i for i, (a, b) in enumerate(itertools.pairwise(targets)) if b > a]
        downs = [i for i, (a, b) in enumerate(itertools.pairwise(targets)) if b < a]
        assert len(ups) == 1 and len(downs) == 1, pool
        # it scaled in only after the load came down (ramp falls from 420 s to 480 s)
        assert steps[downs[0]].snapshot.time_s > 420, pool
    reasons = [s.decision.reason for s in changes(steps)]
    assert any("attention +1 (1 -> 2)" in r for r in reasons)
    assert any("ffn -1 (2 -> 1)" in r for r in reasons)


def test_hysteresis_band_holds() -> None:
    """A signal oscillating between scale_in and scale_out never changes the pool."""
    policy = _policy(max_ranks=3)
    targets = _run(policy, [0.9] * 3 + [0.5, 0.7, 0.3, 0.79, 0.21] * 40, start_ranks=2)
    assert targets[2] == 3  # scaled out on 0.9 (no delay, no cooldown)
    assert set(targets[3:]) == {3}


def test_oscillating_load_with_delay_does_not_flap() -> None:
    """Spikes shorter than scale_out_after_s and dips shorter than scale_in_after_s
    are ignored."""
    policy = _policy(max_ranks=3, scale_out_after_s=5, scale_in_after_s=5)
    spiky = ([0.95] * 3 + [0.1] * 3) * 20
    assert set(_run(policy, spiky, start_ranks=2)) == {2}


def test_scale_out_waits_for_the_delay_then_steps_to_max() -> None:
    policy = _policy(max_ranks=4, step=2, scale_out_after_s=3)
    targets = _run(policy, [0.9] * 12)
    assert targets[:3] == [1, 1, 1]
    assert targets[3] == 3  # held 3 s, +step 2
    assert targets[7] == 4  # fresh 3 s at the new size, then clamped to max 4 (+1, not +2)
    assert targets[-1] == 4


def test_cooldown_blocks_the_next_change() -> None:
    policy = _policy(max_ranks=3, scale_out_cooldown_s=10, scale_in_cooldown_s=20)
    targets = _run(policy, [0.9] * 15 + [0.1] * 30)
    assert targets[0] == 2
    assert targets[1:10] == [2] * 9  # scale-out cooldown 10 s
    assert targets[10] == 3
    assert targets[15:30] == [3] * 15  # scale-in cooldown: 20 s after the change at 10 s
    assert targets[30] == 2


def test_min_max_clamp() -> None:
    policy = _policy(min_ranks=2, max_ranks=3)
    assert _run(policy, [0.5])[0] == 2  # below min: clamped up at once
    assert _run(policy, [0.5], start_ranks=5)[0] == 3  # above max: clamped down
    assert set(_run(policy, [0.99] * 10, start_ranks=3)) == {3}
    assert set(_run(policy, [0.0] * 10, start_ranks=2)) == {2}


def test_pools_decide_independently_and_reasons_name_signal_and_value() -> None:
    policy = AutoscalePolicy.model_validate(
        {
            "attention": {
                "max_ranks": 2,
                "signals": {"kv_cache_usage": {"scale_out": 0.85, "scale_in": 0.3}},
            },
            "ffn": {"max_ranks": 2, "signals": {"ffn_busy_fraction": {"scale_out": 0.8, "scale_in": 0.3}}},
        }
    )
    snapshot = MetricsSnapshot(time_s=0, attention_ranks=1, ffn_ranks=1, kv_cache_usage=0.93, ffn_busy_fraction=0.5)
    decision = decide(snapshot, ScaleState.initial(1, 1), policy)
    assert (decision.attention_target, decision.ffn_target) == (2, 1)
    assert decision.attention_reason == "attention +1 (1 -> 2): kv_cache_usage 0.93 > 0.85 for 0 s"
    assert "hysteresis band" in decision.ffn_reason
    # the bounded label of afd_autoscale_decisions{reason}
    assert (decision.attention_cause, decision.ffn_cause) == ("kv_cache_usage", "in_band")


def test_follow_an_external_resize_starts_a_cooldown() -> None:
    policy = _policy(max_ranks=3, scale_in_cooldown_s=30)
    state = ScaleState.initial(1, 1)
    assert state.follow(1, 1, now=50.0) == state
    moved = state.follow(3, 1, now=50.0)  # a manual resize to 3 attention ranks
    assert (moved.attention.target, moved.attention.last_change_s, moved.ffn) == (3, 50.0, state.ffn)
    idle = MetricsSnapshot(time_s=60.0, attention_ranks=3, ffn_ranks=1, kv_cache_usage=0.0)
    decision = decide(idle, moved, policy)
    assert decision.attention_target == 3 and "cooldown 10 of 30 s" in decision.attention_reason
    assert decide(idle.model_copy(update={"time_s": 80.0}), decision.state, policy).attention_target == 2


def test_state_and_snapshot_round_trip() -> None:
    """State travels as JSON (Serve's policy_state); the snapshot as Serve metrics."""
    snapshot = MetricsSnapshot(time_s=5.0, attention_ranks=2, ffn_ranks=1, kv_cache_usage=0.9, tpot_p90_s=0.1)
    metrics = snapshot.to_serve_metrics()
    assert all(isinstance(v, float) for v in metrics.values())
    assert MetricsSnapshot.from_serve_metrics(metrics) == snapshot
    decision = decide(snapshot, ScaleState.initial(2, 1), _policy(max_ranks=3))
    assert ScaleState.model_validate(decision.state.model_dump()) == decision.state
