"""Markdown tables of a GPU decode benchmark result (`afd_ray.bench.decode`).

`python -m afd_ray.bench.decode_report RESULT.json > RESULT.md`
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["TARGETS", "render"]

TARGETS = {
    "roundtrip_graph_us_max_t128": 25.0,
    "bulk_share_of_p2p_min": 0.85,
    "dbo_exposed_comm_frac_max": 0.10,
}
"""Issue 4's targets: graph round trip per layer at T <= 128 (µs), bulk A2F share of
P2P bandwidth, exposed communication share of a DBO step; and AFD tokens/s/GPU >=
colocated on 2 GPUs at the best batch under the TPOT budget."""


def _f(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def render(result: dict) -> str:
    """The result as markdown: headline targets, connector figures, per-model tables."""
    lines = [
        f"# Decode benchmark on {result.get('gpu')} x{result.get('gpus')} ({result.get('date')})",
        "",
        (
            f"torch {result.get('torch')}, NCCL {result.get('nccl')}, {result.get('dtype')}; "
            f"TPOT budget {result.get('tpot_budget_ms')} ms; headline model: {result.get('headline_model')}."
        ),
        "",
        "## Targets",
        "",
        "| target | measured | limit | met |",
        "|---|---|---|---|",
    ]
    graph = result.get("roundtrip_us_graph") or {}
    small = [graph[t] for t in ("1", "16", "128") if t in graph]
    if small:
        worst = max(small)
        limit = TARGETS["roundtrip_graph_us_max_t128"]
        lines.append(
            f"| round trip per layer in graphs, T ≤ 128 (µs, worst) | {worst:.1f} | ≤ {limit} | {worst <= limit} |"
        )
    share = result.get("bulk_share_of_p2p")
    if share is not None:
        limit = TARGETS["bulk_share_of_p2p_min"]
        lines.append(f"| bulk A2F / NCCL P2P bandwidth | {share:.1%} | ≥ {limit:.0%} | {share >= limit} |")
    exposed = result.get("dbo_exposed_comm_frac")
    if exposed is not None:
        limit = TARGETS["dbo_exposed_comm_frac_max"]
        lines.append(f"| exposed comm / step with DBO | {exposed:.1%} | < {limit:.0%} | {exposed < limit} |")
    tps = result.get("tokens_per_s_per_gpu") or {}
    if "afd_1a1f" in tps and "colocated_2gpu" in tps:
        afd, col2 = tps["afd_1a1f"], tps["colocated_2gpu"]
        lines.append(
            f"| AFD 1A:1F tok/s/GPU vs colocated 2 GPU | {afd:.0f} vs {col2:.0f} | ≥ | {afd >= col2} |"
        )
    lines += ["", "## Connector (H = 2048, bf16)", ""]
    tokens = sorted(set(result.get("roundtrip_us_eager") or {}) | set(graph), key=int)
    if tokens:
        lines += [
            f"A2F + F2A round trip per layer (µs), {result['roundtrip']['layers']} layers per step:",
            "",
            "| mode | " + " | ".join(f"T={t}" for t in tokens) + " |",
            "|---|" + "---|" * len(tokens),
        ]
        for mode in ("eager", "graph"):
            values = result.get(f"roundtrip_us_{mode}") or {}
            lines.append(f"| {mode} | " + " | ".join(_f(values.get(t)) for t in tokens) + " |")
    p2p = result.get("p2p")
    if p2p:
        lines += [
            "",
            (
                f"Bulk: NCCL P2P {p2p['p2p_bulk_GBps']:.0f} GB/s ({p2p['p2p_bulk_bytes'] >> 20} MiB messages), "
                f"A2F through the connector {p2p['a2f_bulk_GBps']:.0f} GB/s ({share:.1%})."
            ),
        ]
    for name, report in (result.get("models") or {}).items():
        lines += ["", f"## {name}", ""]
        kv = "shared across layers" if report.get("kv_shared_across_layers") else "one per layer"
        lines.append(
            f"{report.get('num_layers')} layers, {report.get('attention_kind')} attention, context "
            f"{report.get('context')}; KV buffers: {report.get('kv_layers_distinct')} ({kv}, "
            f"{(report.get('kv_bytes') or 0) / 2**30:.1f} GiB at the largest batch)."
        )
        check = report.get("correctness")
        if check:
            errs = ", ".join(
                f"{k} {v['rel_err']:.1e} / tokens {v['token_match']:.0%}" for k, v in check["checks"].items()
            )
            lines.append(
                f"Correctness (B={check['batch']}, vs colocated eager): passed={check['passed']}: {errs}."
            )
        lines += [
            "",
            (
                "| B | AFD off ms | AFD DBO ms | coloc 1 GPU ms | coloc 2 GPU ms | attn ms (DBO) | FFN ms (DBO) "
                "| exposed comm (DBO) | tok/s/GPU AFD | coloc 1 | coloc 2 |"
            ),
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for batch, row in sorted(report.get("batches", {}).items(), key=lambda kv: int(kv[0])):
            split = row.get("afd_dbo_on_split_ms", {})
            tps_row = row.get("tokens_per_s_per_gpu", {})

            def ms(key: str, row: dict = row) -> str:
                return _f(row.get(key, {}).get("step_ms"), 2)

            exposed_cell = (
                f"{_f(split.get('exposed_comm'), 2)} ({split.get('exposed_comm_frac', 0):.0%})"
                if split
                else "–"
            )
            lines.append(
                f"| {batch} | {ms('afd_dbo_off')} | {ms('afd_dbo_on')} | {ms('colocated_1gpu')} | {ms('colocated_2gpu')} "
                f"| {_f(split.get('attention'), 2)} | {_f(split.get('ffn'), 2)} | {exposed_cell} "
                f"| {_f(tps_row.get('afd_1a1f'), 0)} | {_f(tps_row.get('colocated_1gpu'), 0)} "
                f"| {_f(tps_row.get('colocated_2gpu'), 0)} |"
            )
        best = report.get("best_under_tpot_budget")
        if best:
            lines += ["", "Best batch under the TPOT budget:", ""]
            for layout, b in best.items():
                lines.append(
                    f"- {layout}: {b['tokens_per_s_per_gpu']:.0f} tok/s/GPU at B={b['batch_per_attention_rank']} "
                    f"(TPOT {b['tpot_ms']:.1f} ms)"
                )
    if result.get("graph_failures"):
        lines += ["", f"Graph captures that fell back to eager: {result['graph_failures']}"]
    if result.get("sections_failed"):
        lines += ["", f"Failed sections: {result['sections_failed']}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(json.loads(Path(sys.argv[1]).read_text())), end="")
