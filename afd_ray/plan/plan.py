"""`afd-ray plan`: which A:F ratio and batch per attention rank to run.

Enumerates every layout with A + F ≤ `devices` (A, F ≥ 1), every batch per attention
rank in `batches`, DBO off and on, predicts each with `afd_ray.plan.model`
(formulas and sources there: docs/models.md's AFD traffic per step, Step-3 arXiv 2507.19427 and
MegaScale-Infer arXiv 2504.02263 for the ping-pong overlap), keeps those whose TPOT
meets the SLO, and ranks them by cost per 1M output tokens (equivalently, tokens/s
per device), then by SLO-goodput. The first is the recommendation.
"""

from __future__ import annotations

from collections.abc import Sequence

from afd_ray.plan.model import Estimate, Layout, PerformanceModel

__all__ = ["DEFAULT_BATCHES", "MAX_BATCH", "MAX_CONTEXT", "MAX_DEVICES", "format_plan", "rank_layouts"]

DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

MAX_DEVICES = 256
"""Most devices `rank_layouts` plans for. It enumerates every A + F <= devices, about
devices² / 2 layouts times the batches and DBO off/on: 256 devices are 620,000
estimates with the default batches, 15 s of CPU (`afd-ray plan --devices 100000`
ran for hours); a larger deployment repeats a smaller A:F group."""

MAX_BATCH = 8192
"""Largest batch per attention rank `rank_layouts` (and `afd-ray profile`) takes:
16x the 512 of `DEFAULT_BATCHES` and 8x vLLM's largest default `max_num_seqs` (1024).
The model extrapolates linearly from the profiled batches; `--batches 1000000000`
printed TPOTs of 7.9e7 ms in a table whose columns ran together."""

MAX_CONTEXT = 2**24
"""Largest mean context per sequence `rank_layouts` takes, tokens (16.8M): past the
context window of any served model (the longest, 10M tokens), where the model's
linear extrapolation from the profiled contexts means nothing."""


def rank_layouts(
    model: PerformanceModel,
    devices: int,
    slo_tpot_ms: float,
    context: float,
    output_tokens: int,
    price_per_device_hour: float,
    batches: Sequence[int] = DEFAULT_BATCHES,
) -> list[Estimate]:
    """Every candidate, best first: SLO-meeting ones by cost per 1M tokens, then
    goodput; the rest after them by TPOT.

    Raises:
        ValueError: `devices` < 2 (AFD needs an attention and an FFN rank) or above
            `MAX_DEVICES`, `context` not in (0, `MAX_CONTEXT`], `slo_tpot_ms` <= 0, or
            `batches` empty or with a value outside [1, `MAX_BATCH`]; names the field.
    """
    if devices < 2:
        raise ValueError(f"devices: {devices} < 2; AFD needs at least one attention and one FFN rank")
    if devices > MAX_DEVICES:
        raise ValueError(f"devices: {devices} > {MAX_DEVICES}, the most the planner enumerates (MAX_DEVICES)")
    if not 0 < context <= MAX_CONTEXT:
        raise ValueError(f"context: must be in (0, {MAX_CONTEXT}] tokens (MAX_CONTEXT), got {context}")
    if not slo_tpot_ms > 0:
        raise ValueError(f"slo_tpot_ms: must be > 0, got {slo_tpot_ms}")
    if not batches or not all(1 <= b <= MAX_BATCH for b in batches):
        raise ValueError(f"batches: need at least one, each in [1, {MAX_BATCH}] (MAX_BATCH), got {list(batches)}")
    estimates = [
        model.estimate(Layout(a, f, b, dbo), context, slo_tpot_ms, output_tokens, price_per_device_hour)
        for a in range(1, devices)
        for f in range(1, devices - a + 1)
        for b in batches
        for dbo in (False, True)
        if not dbo or b >= 2
    ]
    return sorted(
        estimates,
        key=lambda e: (not e.meets_slo, e.cost_per_1m_tokens if e.meets_slo else e.tpot_ms, -e.goodput_rps),
    )


def format_plan(ranked: Sequence[Estimate], slo_tpot_ms: float, top: int) -> str:
    """The recommendation and the `top` alternatives as a table."""
    lines = []
    best = ranked[0]
    if best.meets_slo:
        layout = best.layout
        lines.append(
            f"recommended: {layout.label} (A:F = {layout.attention}:{layout.ffn}), batch {layout.batch} per "
            f"attention rank, DBO {'on' if layout.dbo else 'off'}: TPOT {best.tpot_ms:.1f} ms, "
            f"{best.tokens_per_s:.0f} tok/s, SLO-goodput {best.goodput_rps:.2f} req/s, "
            f"cost {best.cost_per_1m_tokens:.3f} per 1M output tokens"
        )
    else:
        lines.append(f"no layout meets TPOT <= {slo_tpot_ms:g} ms; closest below")
    header = (
        f"{'rank':>4} {'layout':<7}{'batch':>6}{'DBO':>5}{'TPOT ms':>9}{'tok/s':>9}{'tok/s/dev':>10}"
        f"{'goodput':>9}{'cost/1M':>10}{'attn ms':>9}{'FFN ms':>8}{'A2F+F2A':>9}"
    )
    lines += [header, "-" * len(header)]
    for i, e in enumerate(ranked[:top], 1):
        lines.append(
            f"{i:>4} {e.layout.label:<7}{e.layout.batch:>6}{'on' if e.layout.dbo else 'off':>5}{e.tpot_ms:>9.2f}"
            f"{e.tokens_per_s:>9.1f}{e.tokens_per_s_per_device:>10.1f}{e.goodput_rps:>9.2f}"
            f"{e.cost_per_1m_tokens:>10.3f}{e.attention_ms:>9.2f}{e.ffn_ms:>8.2f}{e.transfer_ms:>9.2f}"
        )
    lines.append(
        f"goodput: requests/s with TPOT <= {slo_tpot_ms:g} ms (TTFT not modelled); attn/FFN/A2F+F2A: ms per step"
    )
    return "\n".join(lines)
