"""`afd-ray plan`: which A:F ratio and batch per attention rank to run, and whether AFD
beats plain vLLM given the same cores or GPUs.

`rank_layouts` enumerates every layout with A + F ≤ `devices` (A, F ≥ 1), every batch
per attention rank in `batches`, DBO off and on (on where A ≥ 2F), predicts each with
`afd_ray.plan.model` (formulas and sources there), keeps those whose TPOT meets the
SLO, and ranks them by cost per 1M output tokens (equivalently, tokens/s per device),
then by SLO-goodput. The first is the recommendation.

`same_batch` (CPU) puts AFD 1A:1F next to plain vLLM on the same cores at each batch;
`plan_predictions` (CUDA) picks, on 2, 4 and 8 GPUs, the A:F layout and batch with the
most tok/s per GPU at the TPOT bound and plain vLLM DP+EP's best on the same GPUs;
`plan_check` puts the model's TPOT for layouts measured on one GPU next to the
measured TPOT p50.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from afd_ray.plan.model import Estimate, Layout, PerformanceModel, PlainEstimate

__all__ = [
    "CHECK_LAYOUTS",
    "DEFAULT_BATCHES",
    "MAX_BATCH",
    "MAX_CONTEXT",
    "MAX_DEVICES",
    "PREDICTION_GPUS",
    "best_plain",
    "format_plan",
    "plan_check",
    "plan_predictions",
    "rank_layouts",
    "same_batch",
]

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

PREDICTION_GPUS = (2, 4, 8)
"""GPU counts of `plan_predictions` (one node of 8 GPUs and its halves)."""

CHECK_LAYOUTS = ("1A1F", "2A1F-dbo")
"""Layouts `plan_check` checks, all ranks on one GPU (as `benchmarks/h200/product.sh`
runs them)."""


def _check_inputs(context: float, slo_tpot_ms: float, batches: Sequence[int]) -> None:
    if not 0 < context <= MAX_CONTEXT:
        raise ValueError(f"context: must be in (0, {MAX_CONTEXT}] tokens (MAX_CONTEXT), got {context}")
    if not slo_tpot_ms > 0:
        raise ValueError(f"slo_tpot_ms: must be > 0, got {slo_tpot_ms}")
    if not batches or not all(1 <= b <= MAX_BATCH for b in batches):
        raise ValueError(f"batches: need at least one, each in [1, {MAX_BATCH}] (MAX_BATCH), got {list(batches)}")


def _layouts(attention: int, ffn: int, batches: Sequence[int]) -> list[Layout]:
    return [Layout(attention, ffn, b, dbo) for b in batches for dbo in (False, True) if not dbo or attention >= 2 * ffn]


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
    _check_inputs(context, slo_tpot_ms, batches)
    estimates = [
        model.estimate(layout, context, slo_tpot_ms, output_tokens, price_per_device_hour)
        for a in range(1, devices)
        for f in range(1, devices - a + 1)
        for layout in _layouts(a, f, batches)
    ]
    return sorted(
        estimates,
        key=lambda e: (not e.meets_slo, e.cost_per_1m_tokens if e.meets_slo else e.tpot_ms, -e.goodput_rps),
    )


def best_plain(
    model: PerformanceModel, context: float, slo_tpot_ms: float, batches: Sequence[int], gpus: int = 1
) -> PlainEstimate:
    """Plain vLLM's batch with the most tok/s per device meeting the TPOT bound (the
    lowest TPOT if none does), on the profile's cores (CPU) or DP+EP over `gpus` GPUs."""
    estimates = [model.plain(b, context, gpus) for b in batches]
    meeting = [e for e in estimates if e.tpot_ms <= slo_tpot_ms]
    if meeting:
        return max(meeting, key=lambda e: e.tokens_per_s_per_device)
    return min(estimates, key=lambda e: e.tpot_ms)


def same_batch(model: PerformanceModel, context: float, batches: Sequence[int]) -> list[tuple[Estimate, PlainEstimate]]:
    """AFD 1A:1F (on the model's `host_cores`) and plain vLLM (on the profile's
    `plain_devices` cores) at each batch: same batch against same batch."""
    return [(model.estimate(Layout(1, 1, b), context, float("inf"), 1, 1.0), model.plain(b, context)) for b in batches]


def plan_predictions(
    model: PerformanceModel,
    slo_tpot_ms: float,
    context: float,
    batches: Sequence[int] = DEFAULT_BATCHES,
    gpus: Sequence[int] = PREDICTION_GPUS,
) -> dict[str, dict[str, float | int | bool]]:
    """For each GPU count G: the layout with A + F = G, batch and DBO with the most
    tok/s per GPU whose TPOT meets `slo_tpot_ms` (the lowest TPOT if none does), and
    plain vLLM DP+EP's best batch on the same G GPUs. `model` must have one GPU per
    rank (`host_cores` None).

    Returns:
        layout label -> `{gpus, batch, dbo, tok_s_per_gpu, tpot_ms, meets_slo,
        plain_batch, plain_tpot_ms, plain_tok_s_per_gpu}` (tok/s per GPU, TPOT in ms,
        batch per attention rank, or per GPU for plain vLLM).

    Raises:
        ValueError: see `rank_layouts`; `model.host_cores` is set.
    """
    if model.host_cores is not None:
        raise ValueError("host_cores: plan_predictions places one rank per GPU; leave host_cores unset")
    _check_inputs(context, slo_tpot_ms, batches)
    out: dict[str, dict[str, float | int | bool]] = {}
    for g in gpus:
        estimates = [
            model.estimate(layout, context, slo_tpot_ms, 1, 1.0)
            for a in range(1, g)
            for layout in _layouts(a, g - a, batches)
        ]
        meeting = [e for e in estimates if e.meets_slo]
        best = max(meeting, key=lambda e: e.tokens_per_s_per_device) if meeting else min(estimates, key=_tpot)
        plain = best_plain(model, context, slo_tpot_ms, batches, g)
        out[best.layout.label] = {
            "gpus": g,
            "batch": best.layout.batch,
            "dbo": best.layout.dbo,
            "tok_s_per_gpu": best.tokens_per_s_per_device,
            "tpot_ms": best.tpot_ms,
            "meets_slo": best.meets_slo,
            "plain_batch": plain.batch,
            "plain_tpot_ms": plain.tpot_ms,
            "plain_tok_s_per_gpu": plain.tokens_per_s_per_device,
        }
    return out


def _tpot(e: Estimate) -> float:
    return e.tpot_ms


def plan_check(model: PerformanceModel, measured: Sequence[object]) -> dict[str, dict[str, float | int]]:
    """The model's TPOT for each `CHECK_LAYOUTS` layout measured on one GPU against its
    measured TPOT p50 (the median over repeats), at the largest batch measured for it.

    Args:
        model: fitted with `host_cores=1` (every rank on the one GPU).
        measured: `afd_ray.bench.BenchResult`s holding runs of those layouts (label
            `1A1F`, `2A1F-dbo`; batch per attention rank = concurrency / A; context =
            prompt + half the output).

    Returns:
        label -> `{batch, predicted_tpot_ms, measured_tpot_ms, rel_err}` with rel_err =
        predicted / measured − 1; layouts not measured are left out.
    """
    runs: dict[str, dict[int, list[tuple[float, float]]]] = {}
    for result in measured:
        for run in result.runs:
            if run.label in CHECK_LAYOUTS:
                context = run.prompt_tokens + result.config.max_tokens / 2
                runs.setdefault(run.label, {}).setdefault(run.concurrency, []).append((run.tpot.p50_ms, context))
    out: dict[str, dict[str, float | int]] = {}
    for label, by_batch in runs.items():
        concurrency = max(by_batch)
        attention = 2 if label.startswith("2A") else 1
        batch = concurrency // attention
        tpots, contexts = zip(*by_batch[concurrency], strict=True)
        measured_ms = statistics.median(tpots)
        predicted = model.tpot(Layout(attention, 1, batch, label.endswith("-dbo")), statistics.fmean(contexts))[0]
        out[label] = {
            "batch": batch,
            "predicted_tpot_ms": predicted,
            "measured_tpot_ms": measured_ms,
            "rel_err": predicted / measured_ms - 1,
        }
    return out


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
        f"{'rank':>4} {'layout':<9}{'batch':>6}{'TPOT ms':>9}{'tok/s':>9}{'tok/s/dev':>10}"
        f"{'goodput':>9}{'cost/1M':>10}{'attn ms':>9}{'FFN ms':>8}{'A2F+F2A':>9}"
    )
    lines += [header, "-" * len(header)]
    for i, e in enumerate(ranked[:top], 1):
        lines.append(
            f"{i:>4} {e.layout.label:<9}{e.layout.batch:>6}{e.tpot_ms:>9.2f}"
            f"{e.tokens_per_s:>9.1f}{e.tokens_per_s_per_device:>10.1f}{e.goodput_rps:>9.2f}"
            f"{e.cost_per_1m_tokens:>10.3f}{e.attention_ms:>9.2f}{e.ffn_ms:>8.2f}{e.transfer_ms:>9.2f}"
        )
    lines.append(
        f"goodput: requests/s with TPOT <= {slo_tpot_ms:g} ms (TTFT not modelled); attn/FFN/A2F+F2A: ms per step"
    )
    return "\n".join(lines)
