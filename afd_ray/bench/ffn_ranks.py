"""One FFN rank's figures over a measured load, from its `/afd/status` counters
before and after (`FFNMember`): traffic per step, busy share, its own compute and EP
time per step, and its step split (`afd_ray.observability.timeline`)."""

from __future__ import annotations

from afd_ray.bench.schema import FFNRankResult, StepSplitResult
from afd_ray.control.membership import FFNMember

__all__ = ["ffn_rank_result"]


def ffn_rank_result(
    before: FFNMember, after: FFNMember, wall_s: float, layers: int, hidden: int, elem: int
) -> FFNRankResult:
    """Counter deltas of one FFN rank over the load, next to the AFD traffic per step of docs/models.md.

    Raises:
        RuntimeError: the rank served no step during the load.
    """
    steps = after.steps - before.steps
    if steps <= 0:
        raise RuntimeError(f"FFN rank {after.rank} served no step during the load")
    tokens = after.tokens - before.tokens
    return FFNRankResult(
        rank=after.rank,
        steps=steps,
        tokens=tokens,
        mean_tokens_per_step=tokens / steps,
        a2f_bytes_per_step=(after.a2f_bytes - before.a2f_bytes) / steps,
        f2a_bytes_per_step=(after.f2a_bytes - before.f2a_bytes) / steps,
        formula_bytes_per_step=2 * layers * (tokens / steps) * hidden * elem,
        busy_fraction=(after.busy_s - before.busy_s) / wall_s,
        compute_ms_per_step=(after.compute_s - before.compute_s) * 1e3 / steps,
        ep_ms_per_step=(after.ep_s - before.ep_s) * 1e3 / steps,
        split=_step_split(before, after),
    )


def _step_split(before: FFNMember, after: FFNMember) -> StepSplitResult | None:
    """The step split of one FFN rank over the load (the growth of its `split`);
    None when no step of the load was timed."""
    d = after.split - before.split
    if d.steps <= 0:
        return None
    total = d.attention_s + d.wire_s + d.ffn_s + d.idle_s
    ms, share = 1e3 / d.steps, 1 / total if total > 0 else 0.0
    return StepSplitResult(
        timed_steps=d.steps,
        step_ms=total * ms,
        attention_ms=d.attention_s * ms,
        wire_ms=d.wire_s * ms,
        ffn_ms=d.ffn_s * ms,
        idle_ms=d.idle_s * ms,
        attention_fraction=d.attention_s * share,
        wire_fraction=d.wire_s * share,
        ffn_fraction=d.ffn_s * share,
        idle_fraction=d.idle_s * share,
    )
