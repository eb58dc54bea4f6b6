"""What `afd-ray plan` prints and writes beside the ranking: AFD against plain vLLM at
equal resources, and on CUDA the multi-GPU predictions and the one-GPU check.

The JSON (`afd-ray plan --out`) holds:

- `recommended`: the first of the ranking (`layout`, `batch`, `tpot_ms`, `tok_s`, `tok_s_per_device`);
- `equal_resources`: the best AFD layout meeting the TPOT bound against plain vLLM's
  best batch on the same cores (CPU: both on the host's cores, total tok/s) or GPUs
  (CUDA: DP+EP on the layout's A + F GPUs, tok/s per GPU), `afd_over_plain` and `winner`;
- `same_batch` (CPU): batch -> AFD 1A:1F and plain vLLM's TPOT and tok/s on the same cores;
- `plan_predictions` (CUDA): layout -> `{gpus, tok_s_per_gpu, tpot_ms, plain_tok_s_per_gpu, ...}`
  on 2, 4 and 8 GPUs (`afd_ray.plan.plan.plan_predictions`);
- `plan_check` (CUDA, with `--measured`): layout -> `{predicted_tpot_ms,
  measured_tpot_ms, rel_err, batch}` for 1A1F and 2A1F-dbo on one GPU.

Units: ms, output tokens/s.
"""

from __future__ import annotations

from collections.abc import Sequence

from afd_ray.plan.model import Estimate, PerformanceModel
from afd_ray.plan.plan import best_plain, plan_check, plan_predictions, same_batch

__all__ = ["plan_report"]


def _equal_resources(
    model: PerformanceModel, ranked: Sequence[Estimate], slo: float, context: float, batches: Sequence[int]
) -> tuple[dict[str, object], str]:
    cpu = model.profile.platform == "cpu"
    meeting = [e for e in ranked if e.meets_slo] or list(ranked)
    if cpu:  # every layout runs on the same host cores: total tok/s
        afd = max(meeting, key=lambda e: e.tokens_per_s)
        plain = best_plain(model, context, slo, batches)
        afd_rate, plain_rate, unit = afd.tokens_per_s, plain.tokens_per_s, "tok/s"
        where = f"plain vLLM on {model.profile.plain_devices:g} cores"
    else:
        afd = max(meeting, key=lambda e: e.tokens_per_s_per_device)
        gpus = afd.layout.attention + afd.layout.ffn
        plain = best_plain(model, context, slo, batches, gpus)
        afd_rate, plain_rate, unit = afd.tokens_per_s_per_device, plain.tokens_per_s_per_device, "tok/s per GPU"
        where = f"plain vLLM DP+EP on {gpus} GPUs"
    ratio = afd_rate / plain_rate
    winner = "afd" if ratio > 1 else "plain"
    text = (
        f"equal resources: AFD {afd.layout.label} batch {afd.layout.batch}: {afd_rate:.1f} {unit} "
        f"(TPOT {afd.tpot_ms:.1f} ms) vs {where} batch {plain.batch}: {plain_rate:.1f} {unit} "
        f"(TPOT {plain.tpot_ms:.1f} ms): {'AFD pays' if winner == 'afd' else 'plain vLLM wins'} "
        f"(AFD/plain {ratio:.2f}x)"
    )
    profiled = max(p.batch for p in model.profile.points)
    beyond = [f"{side} batch {b}" for side, b in (("AFD", afd.layout.batch), ("plain", plain.batch)) if b > profiled]
    if beyond:
        text += (
            f"\nnote: {' and '.join(beyond)} beyond the profiled batches (at most {profiled}): "
            "extrapolated from the fits"
        )
    record = {
        "afd": {"layout": afd.layout.label, "batch": afd.layout.batch, "tpot_ms": afd.tpot_ms, "rate": afd_rate},
        "plain": {"devices": plain.devices, "batch": plain.batch, "tpot_ms": plain.tpot_ms, "rate": plain_rate},
        "unit": unit,
        "afd_over_plain": ratio,
        "winner": winner,
    }
    return record, text


def plan_report(
    model: PerformanceModel,
    ranked: Sequence[Estimate],
    slo_tpot_ms: float,
    context: float,
    batches: Sequence[int],
    measured: Sequence[object] = (),
) -> tuple[dict[str, object], str]:
    """The JSON record (module docstring) and its text for `afd-ray plan`.

    Args:
        model: as the ranking used (CPU: `host_cores` set; CUDA: unset).
        ranked: `rank_layouts`'s result.
        measured: `afd_ray.bench.BenchResult`s for `plan_check` (CUDA only).
    """
    profile = model.profile
    best = ranked[0]
    report: dict[str, object] = {
        "model": profile.model,
        "device": profile.device,
        "platform": profile.platform,
        "host_cores": model.host_cores,
        "slo_tpot_ms": slo_tpot_ms,
        "context": context,
        "recommended": {
            "layout": best.layout.label,
            "batch": best.layout.batch,
            "meets_slo": best.meets_slo,
            "tpot_ms": best.tpot_ms,
            "tok_s": best.tokens_per_s,
            "tok_s_per_device": best.tokens_per_s_per_device,
        },
    }
    report["equal_resources"], line = _equal_resources(model, ranked, slo_tpot_ms, context, batches)
    lines = [line]
    if profile.platform == "cpu":
        rows = same_batch(model, context, batches)
        report["same_batch"] = {
            str(afd.layout.batch): {
                "afd_tpot_ms": afd.tpot_ms,
                "afd_tok_s": afd.tokens_per_s,
                "plain_tpot_ms": plain.tpot_ms,
                "plain_tok_s": plain.tokens_per_s,
            }
            for afd, plain in rows
        }
        lines.append(f"same batch, AFD 1A:1F vs plain vLLM on {profile.plain_devices:g} cores:")
        lines.append(
            f"{'batch':>6}{'AFD TPOT':>10}{'AFD tok/s':>11}{'plain TPOT':>12}{'plain tok/s':>13}{'AFD/plain':>11}"
        )
        for afd, plain in rows:
            lines.append(
                f"{afd.layout.batch:>6}{afd.tpot_ms:>10.1f}{afd.tokens_per_s:>11.1f}{plain.tpot_ms:>12.1f}"
                f"{plain.tokens_per_s:>13.1f}{afd.tokens_per_s / plain.tokens_per_s:>10.2f}x"
            )
        return report, "\n".join(lines)
    predictions = plan_predictions(PerformanceModel(profile), slo_tpot_ms, context, batches)
    report["plan_predictions"] = predictions
    lines.append(f"predictions at TPOT <= {slo_tpot_ms:g} ms, against plain vLLM DP+EP on the same GPUs:")
    lines.append(
        f"{'GPUs':>5} {'layout':<10}{'batch':>6}{'TPOT':>8}{'tok/s/GPU':>11}{'plain b':>9}{'plain tok/s/GPU':>17}"
    )
    for label, p in predictions.items():
        lines.append(
            f"{p['gpus']:>5} {label:<10}{p['batch']:>6}{p['tpot_ms']:>8.2f}{p['tok_s_per_gpu']:>11.1f}"
            f"{p['plain_batch']:>9}{p['plain_tok_s_per_gpu']:>17.1f}"
        )
    if measured:
        check = plan_check(PerformanceModel(profile, host_cores=1), measured)
        report["plan_check"] = check
        lines.append("check on one GPU (predicted vs measured TPOT p50):")
        for label, c in check.items():
            lines.append(
                f"  {label:<10} batch {c['batch']}: {c['predicted_tpot_ms']:.2f} vs {c['measured_tpot_ms']:.2f} ms "
                f"({c['rel_err']:+.1%})"
            )
    return report, "\n".join(lines)
