"""`afd-ray trace` and `afd-ray dashboards` (registered by `afd_ray.cli`)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from afd_ray.argtypes import check_writable, http_url

__all__ = ["add_dashboards", "add_trace", "format_trace"]

DEFAULT_DASHBOARD = Path("dashboards/afd.json")
_PARTS = ("attention_s", "wire_s", "ffn_queue_s", "ffn_compute_s", "ep_collective_s", "f2a_s")
_HEADINGS = ("attention", "A2F wire/wait", "FFN queue", "FFN compute", "EP coll.", "F2A")


def format_trace(request_id: str, steps: list[dict[str, object]]) -> str:
    """A table of `GET /afd/trace/<id>`'s steps, milliseconds, with the totals and each
    part's share of the total; with EP, each step's slowest FFN rank and its compute
    (`ffn_rank_compute_s`), and every FFN rank's compute summed over the steps."""
    head = f"{'step':>6} {'rank':>4} {'tokens':>6} {'total':>8} " + " ".join(f"{h:>13}" for h in _HEADINGS)
    ep = any(step.get("ffn_rank_compute_s") for step in steps)
    lines = [f"request {request_id}: {len(steps)} engine steps (ms)", head + (" slowest FFN rank" if ep else "")]
    by_rank: dict[str, float] = {}
    for step in steps:
        parts = " ".join(f"{1e3 * float(step[p]):13.2f}" for p in _PARTS)
        ranks: dict[str, float] = step.get("ffn_rank_compute_s") or {}  # JSON keys: strings
        for rank, seconds in ranks.items():
            by_rank[rank] = by_rank.get(rank, 0.0) + seconds
        slowest = max(ranks, key=ranks.__getitem__) if ranks else None
        straggler = f" {slowest:>4} {1e3 * ranks[slowest]:8.2f}" if slowest is not None else ""
        lines.append(
            f"{step['step_id']:>6} {step['attention_rank']:>4} {step['num_tokens']:>6} "
            f"{1e3 * float(step['total_s']):8.2f} {parts}{straggler}"
        )
    total = sum(float(step["total_s"]) for step in steps)
    sums = [sum(float(step[p]) for step in steps) for p in _PARTS]
    lines.append(f"{'sum':>6} {'':>4} {'':>6} {1e3 * total:8.2f} " + " ".join(f"{1e3 * s:13.2f}" for s in sums))
    if total > 0:
        lines.append(f"{'share':>6} {'':>4} {'':>6} {'':>8} " + " ".join(f"{100 * s / total:12.1f}%" for s in sums))
    if by_rank:
        ranks_ms = ", ".join(
            f"rank {rank} {1e3 * s:.2f}" for rank, s in sorted(by_rank.items(), key=lambda r: int(r[0]))
        )
        lines.append(f"FFN compute per FFN rank over these steps (ms, EP collectives excluded): {ranks_ms}")
    return "\n".join(lines)


def _trace(args: argparse.Namespace) -> None:
    import httpx

    try:
        response = httpx.get(f"{args.url.rstrip('/')}/afd/trace/{args.request_id}", timeout=30)
    except httpx.HTTPError as e:
        raise OSError(f"{args.url}: {e}") from e
    if response.status_code != 200:
        raise ValueError(f"{response.status_code}: {response.text}")
    steps = response.json()["steps"]
    print(json.dumps(steps, indent=2) if args.json else format_trace(args.request_id, steps))


def add_trace(subparsers: argparse._SubParsersAction) -> None:
    trace = subparsers.add_parser(
        "trace",
        help="split each engine step (output token) of a request across attention compute, A2F wire/wait, "
        "FFN queue, FFN compute, EP collectives and F2A (GET /afd/trace/<id>)",
    )
    trace.add_argument("request_id", help="the request's id as the OpenAI answer gives it (cmpl-..., chatcmpl-...)")
    trace.add_argument("--url", type=http_url, default="http://127.0.0.1:8000", help="the deployment's HTTP address")
    trace.add_argument("--json", action="store_true", help="print the steps as JSON")
    trace.set_defaults(handler=_trace)


def _export(args: argparse.Namespace) -> None:
    from afd_ray.observability.dashboards import write

    check_writable(args.out)
    print(write(args.out))


def _push(args: argparse.Namespace) -> None:
    from afd_ray.observability.dashboards import push

    token = os.environ.get(args.token_env)
    if not token:
        raise ValueError(f"--token-env: environment variable {args.token_env} is unset or empty")
    print(json.dumps(push(args.url, token, args.folder_uid)))


def add_dashboards(subparsers: argparse._SubParsersAction) -> None:
    dashboards = subparsers.add_parser("dashboards", help="the Grafana dashboard of the afd_* and vLLM metrics")
    sub = dashboards.add_subparsers(dest="dashboards_command", required=True, metavar="COMMAND")
    export = sub.add_parser("export", help="write the dashboard JSON (prints its path)")
    export.add_argument("--out", type=Path, default=DEFAULT_DASHBOARD, help=f"default: {DEFAULT_DASHBOARD}")
    export.set_defaults(handler=_export)
    push = sub.add_parser("push", help="create or update the dashboard in a Grafana (grafana-client)")
    push.add_argument("--url", type=http_url, required=True, help="Grafana's address, e.g. http://grafana:3000")
    push.add_argument("--token-env", required=True, help="environment variable holding a Grafana service-account token")
    push.add_argument("--folder-uid", default=None, help="Grafana folder to put it in (default: General)")
    push.set_defaults(handler=_push)
