"""Derived figures of the GPU decode benchmark (`afd_ray.bench.decode`): the step split
and tokens/s per GPU of one batch row, and the best batch of each layout under the
TPOT budget. Pure arithmetic on the result dict (times in ms, as measured)."""

from __future__ import annotations

__all__ = ["breakdown", "summarize"]


def breakdown(batch: int, row: dict) -> None:
    """Step split into attention, FFN, exposed communication and idle (ms), from
    the stages timed alone; tokens/s per GPU of every layout."""
    for dbo, ub in (("off", 1), ("on", 2)):
        step = row[f"afd_dbo_{dbo}"]["step_ms"]
        gpu_step = row[f"afd_dbo_{dbo}"]["gpu_ms"]
        attention, ffn = row[f"attention_ub{ub}"]["gpu_ms"], row[f"ffn_ub{ub}"]["gpu_ms"]
        busy = attention + ffn if ub == 1 else max(attention, ffn)
        exposed = max(0.0, gpu_step - busy)
        row[f"afd_dbo_{dbo}_split_ms"] = {
            "step": step,
            "attention": attention,
            "ffn": ffn,
            "exposed_comm": exposed,
            "exposed_comm_frac": exposed / gpu_step,
            "host_and_header": max(0.0, step - gpu_step),
            "idle_attention_gpu": step - attention,
            "idle_ffn_gpu": step - ffn,
        }
    best_afd = min(row["afd_dbo_off"]["step_ms"], row["afd_dbo_on"]["step_ms"])
    row["tokens_per_s_per_gpu"] = {
        "afd_1a1f": batch / (best_afd / 1e3) / 2,
        "colocated_1gpu": batch / (row["colocated_1gpu"]["step_ms"] / 1e3),
    }
    if "colocated_2gpu" in row:
        row["tokens_per_s_per_gpu"]["colocated_2gpu"] = batch / (row["colocated_2gpu"]["step_ms"] / 1e3)


def summarize(results: dict, budget: float) -> None:
    """Best batch of each layout with a TPOT (step time, ms) within `budget`, per model,
    under `models/<name>/best_under_tpot_budget`; headline keys from the first model."""
    headline = None
    for name, report in results.get("models", {}).items():
        best = {}
        for layout, key in (
            ("afd_1a1f", None),
            ("colocated_1gpu", "colocated_1gpu"),
            ("colocated_2gpu", "colocated_2gpu"),
        ):
            candidates = []
            for batch, row in report["batches"].items():
                if "tokens_per_s_per_gpu" not in row or layout not in row["tokens_per_s_per_gpu"]:
                    continue
                if key is None:
                    dbo = "on" if row["afd_dbo_on"]["step_ms"] <= row["afd_dbo_off"]["step_ms"] else "off"
                    tpot = row[f"afd_dbo_{dbo}"]["step_ms"]
                else:
                    tpot = row[key]["step_ms"]
                if tpot <= budget:
                    candidates.append((row["tokens_per_s_per_gpu"][layout], int(batch), tpot))
            if candidates:
                tps, batch, tpot = max(candidates)
                best[layout] = {
                    "tokens_per_s_per_gpu": tps,
                    "batch_per_attention_rank": batch,
                    "tpot_ms": tpot,
                }
        report["best_under_tpot_budget"] = best
        if best.get("afd_1a1f"):
            row = report["batches"][str(best["afd_1a1f"]["batch_per_attention_rank"])]
            report["dbo_exposed_comm_frac"] = row["afd_dbo_on_split_ms"]["exposed_comm_frac"]
        if headline is None:
            headline = (name, report, best)
    if headline is not None:
        name, report, best = headline
        results["headline_model"] = name
        results["tokens_per_s_per_gpu"] = {k: v["tokens_per_s_per_gpu"] for k, v in best.items()}
        results["tokens_per_s_per_gpu_detail"] = best
        results["tpot_budget_ms"] = budget
        results["dbo_exposed_comm_frac"] = report.get("dbo_exposed_comm_frac")
