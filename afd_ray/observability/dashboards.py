"""The Grafana dashboard `dashboards/afd.json`, generated from the metric definitions.

Every `afd_*` query is built from `afd_ray.observability.metrics.METRICS` (their
exported series names), and the vLLM ones from vLLM's `vllm:*` names as its Ray stat
logger exports them (`ray_vllm_*`). `dashboard()` is the whole JSON model;
`push` creates or updates it in a Grafana through grafana-client.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from afd_ray.observability.metrics import Kind, by_name

__all__ = ["DASHBOARD_UID", "Panel", "PANELS", "dashboard", "panel_queries", "push", "write"]

DASHBOARD_UID = "afd-ray"
RATE = "$__rate_interval"
"""Grafana's rate window variable; a caller querying Prometheus directly replaces it."""


def _series(name: str) -> str:
    """The exported series of `afd_*` metric `name` (checked against `METRICS`)."""
    return by_name(name).series


def _vllm(name: str, kind: Kind) -> str:
    """vLLM metric `vllm:<name>` as its Ray stat logger exports it."""
    return f"ray_vllm_{name}_total" if kind is Kind.COUNTER else f"ray_vllm_{name}"


def _quantiles(bucket_series: str, by: str = "") -> list[tuple[str, str]]:
    """p50/p90/p99 of a histogram over all series (or per `by` label)."""
    group = f"le, {by}" if by else "le"
    legend = f"p{{q}} {{{{{by}}}}}" if by else "p{q}"
    return [
        (f"histogram_quantile({q / 100}, sum by ({group}) (rate({bucket_series}_bucket[{RATE}])))", legend.format(q=q))
        for q in (50, 90, 99)
    ]


def _mean_per_step(series: str, by: str = "rank") -> tuple[str, str]:
    return (
        f"sum by ({by}) (rate({series}_sum[{RATE}])) / sum by ({by}) (rate({series}_count[{RATE}]))",
        f"{{{{{by}}}}}",
    )


@dataclass(frozen=True)
class Panel:
    """One time-series panel: its title, unit (Grafana's) and (PromQL, legend) queries."""

    title: str
    unit: str
    queries: tuple[tuple[str, str], ...]
    description: str = ""


PANELS: tuple[Panel, ...] = (
    Panel(
        "Pool sizes and epoch",
        "short",
        (
            (f"max by (pool) ({_series('afd_pool_ranks')})", "{{pool}} ranks"),
            (f"max by (pool) ({_series('afd_pool_target_ranks')})", "{{pool}} target"),
            (f"max({_series('afd_epoch')})", "epoch"),
        ),
        "Live members and targets of the attention and FFN pools, the FFN standby ranks (ffn_standby), "
        "and the membership epoch.",
    ),
    Panel(
        "TTFT",
        "s",
        tuple(_quantiles(_vllm("time_to_first_token_seconds", Kind.HISTOGRAM))),
        "Time to first token (vLLM).",
    ),
    Panel(
        "TPOT",
        "s",
        tuple(_quantiles(_vllm("request_time_per_output_token_seconds", Kind.HISTOGRAM))),
        "Mean time per output token of finished requests (vLLM).",
    ),
    Panel(
        "ITL",
        "s",
        tuple(_quantiles(_vllm("inter_token_latency_seconds", Kind.HISTOGRAM))),
        "Inter-token latency (vLLM).",
    ),
    Panel(
        "Tokens/s",
        "short",
        (
            (f"sum(rate({_vllm('generation_tokens', Kind.COUNTER)}[{RATE}]))", "generated (vLLM)"),
            (f"sum(rate({_series('afd_ffn_tokens')}[{RATE}]))", "FFN token rows"),
            (f"sum(rate({_series('afd_ffn_steps')}[{RATE}]))", "FFN steps"),
        ),
        "Output tokens per second, and token rows and steps per second through the FFN pool.",
    ),
    Panel(
        "KV cache usage",
        "percentunit",
        ((f"max by (ReplicaId) ({_vllm('kv_cache_usage_perc', Kind.GAUGE)})", "{{ReplicaId}}"),),
        "Fraction of KV-cache blocks in use per attention replica (vLLM).",
    ),
    Panel(
        "Running requests",
        "short",
        ((f"sum by (ReplicaId) ({_vllm('num_requests_running', Kind.GAUGE)})", "{{ReplicaId}}"),),
        "Requests decoding per attention replica (vLLM; waiting ones queue in Serve, up to "
        "attention.max_num_seqs per rank run).",
    ),
    Panel(
        "FFN busy",
        "percentunit",
        ((f"sum by (rank) (rate({_series('afd_ffn_busy_seconds')}[{RATE}]))", "FFN rank {{rank}}"),),
        "Fraction of wall time each FFN rank spends inside steps.",
    ),
    Panel(
        "Tokens per FFN step",
        "short",
        (
            _mean_per_step(_series("afd_ffn_tokens_per_step")),
            *_quantiles(_series("afd_ffn_tokens_per_step")),
        ),
        "Token rows in one FFN step: mean per FFN rank, and quantiles.",
    ),
    Panel(
        "FFN step time",
        "s",
        (
            (
                f"sum(rate({_series('afd_ffn_compute_seconds')}_sum[{RATE}])) / "
                f"sum(rate({_series('afd_ffn_compute_seconds')}_count[{RATE}]))",
                "compute",
            ),
            (
                f"sum(rate({_series('afd_ffn_ep_collective_seconds')}_sum[{RATE}])) / "
                f"sum(rate({_series('afd_ffn_ep_collective_seconds')}_count[{RATE}]))",
                "EP collectives",
            ),
            (
                f"sum(rate({_series('afd_ffn_queue_seconds')}_sum[{RATE}])) / "
                f"sum(rate({_series('afd_ffn_queue_seconds')}_count[{RATE}]))",
                "batching window",
            ),
        ),
        "Mean per FFN step: compute, EP collectives, batching-window wait.",
    ),
    Panel(
        "FFN step split",
        "s",
        (
            (
                f"sum by (rank, part) (rate({_series('afd_ffn_split_seconds')}[{RATE}])) / on (rank) group_left "
                f"sum by (rank) (rate({_series('afd_ffn_split_steps')}[{RATE}]))",
                "rank {{rank}} {{part}}",
            ),
        ),
        "Mean per timed FFN step, on the FFN rank's device timeline: waiting for the attention rank's "
        "layers and A2F (attention), F2A (wire), FFN compute with EP (ffn), and before the first layer (idle).",
    ),
    Panel(
        "Connector wait",
        "s",
        tuple(_quantiles(_series("afd_connector_wait_seconds"))),
        "Time an attention step is blocked in the FFN exchange (A2F to F2A, all layers).",
    ),
    Panel(
        "A2F / F2A bytes/s",
        "Bps",
        (
            (f"sum(rate({_series('afd_a2f_bytes')}[{RATE}]))", "A2F"),
            (f"sum(rate({_series('afd_f2a_bytes')}[{RATE}]))", "F2A"),
        ),
        "Bytes per second between the pools.",
    ),
    Panel(
        "Expert load",
        "short",
        (
            (f"sum by (expert) (rate({_series('afd_expert_tokens')}[{RATE}]))", "expert {{expert}}"),
            (f"max by (rank) ({_series('afd_expert_imbalance')})", "imbalance (max/mean) rank {{rank}}"),
        ),
        "Rows routed per expert per second, and max/mean imbalance per FFN rank.",
    ),
    Panel(
        "Expert balancedness (EPLB)",
        "percentunit",
        (
            (f"max by (layer) ({_series('afd_eplb_balancedness')})", "MoE layer {{layer}}"),
            (f"min({_series('afd_eplb_balancedness')})", "worst layer"),
        ),
        "Per MoE layer: mean over max of the EP ranks' routed rows over the load window (1 = balanced); "
        "every step waits for the busiest rank. A rebalance (POST /afd/eplb or ffn.eplb.enabled) raises it.",
    ),
    # Resizes are rare: totals since the coordinator started (a rate over a window
    # would show nothing for the first one, whose series starts at 1).
    Panel(
        "Resizes",
        "s",
        (
            (f"sum by (trigger, outcome) ({_series('afd_resizes')})", "resizes {{trigger}} {{outcome}}"),
            (
                f"max by (trigger) ({_series('afd_resize_seconds')}_sum / {_series('afd_resize_seconds')}_count)",
                "mean duration {{trigger}}",
            ),
            (
                f"max by (trigger) ({_series('afd_resize_pause_seconds')}_sum / "
                f"{_series('afd_resize_pause_seconds')}_count)",
                "mean pause {{trigger}}",
            ),
        ),
        "Resizes finished since the coordinator started, their mean duration and longest FFN step-boundary pause.",
    ),
    Panel(
        "Autoscaler decisions",
        "short",
        (
            (
                f"sum by (pool, action, reason) (increase({_series('afd_autoscale_decisions')}[{RATE}]))",
                "{{pool}} {{action}} ({{reason}})",
            ),
        ),
        "Autoscaler evaluations per pool, action and reason (the deciding signal, all_below, bounds, "
        "in_band or no_signals).",
    ),
)


def panel_queries() -> list[tuple[str, str]]:
    """Every (panel title, PromQL) of the dashboard."""
    return [(panel.title, expr) for panel in PANELS for expr, _ in panel.queries]


def dashboard() -> dict[str, object]:
    """The Grafana dashboard JSON model (schema 39), a Prometheus data source picked
    through the `datasource` variable."""
    source = {"type": "prometheus", "uid": "${datasource}"}
    panels = []
    for i, panel in enumerate(PANELS):
        panels.append(
            {
                "id": i + 1,
                "type": "timeseries",
                "title": panel.title,
                "description": panel.description,
                "datasource": source,
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                "targets": [
                    {"refId": chr(ord("A") + j), "expr": expr, "legendFormat": legend, "datasource": source}
                    for j, (expr, legend) in enumerate(panel.queries)
                ],
            }
        )
    return {
        "uid": DASHBOARD_UID,
        "title": "AFD on Ray",
        "tags": ["afd-ray", "vllm", "ray"],
        "schemaVersion": 39,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                }
            ]
        },
        "panels": panels,
    }


def write(path: Path) -> Path:
    """Write `dashboard()` as indented JSON to `path`; returns `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dashboard(), indent=2) + "\n")
    return path


def push(url: str, token: str, folder_uid: str | None = None) -> dict[str, object]:
    """Create or update the dashboard (same `uid`) in the Grafana at `url` with
    grafana-client, authenticated by the service-account `token`.

    Returns Grafana's answer (`uid`, `url`, `version`, `status`).

    Raises:
        grafana_client.client.GrafanaException: Grafana refused it (bad token, ...).
        niquests.exceptions.ConnectionError: nothing answers at `url`.
    """
    from grafana_client import GrafanaApi

    api = GrafanaApi.from_url(url, credential=token)
    body: dict[str, object] = {"dashboard": dashboard(), "overwrite": True, "message": "afd-ray dashboards push"}
    if folder_uid is not None:
        body["folderUid"] = folder_uid
    return api.dashboard.update_dashboard(body)
