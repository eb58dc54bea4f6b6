"""`python -m afd_ray.bench sweep`: deploy A:F layouts one after another under one load.

    python -m afd_ray.bench sweep --attention 1-2 --ffn 1-2 --out sweep.json
    python -m afd_ray.bench sweep --topologies 1A1F 2A1F 1A2F --slo-tpot-ms 80 --slo-ttft-ms 1500

Layouts are a list (`--topologies`, as in the bench) or ranges (`--attention` and
`--ffn`, each `N`, `N-M` or `N,M,...`; every A × F pair, A outer). Every other flag is
the bench's (`python -m afd_ray.bench --help`): the same load is sent to every layout
(one `--concurrency` value), each layout deployed once (`--repeats 1`: the sweep
ranks layouts by SLO-goodput and cost; the plain-vs-AFD comparison with repeats is
the bench's).
It connects to Ray as the bench does: as a Ray job (`JobSubmissionClient.submit_job(
entrypoint="python -m afd_ray.bench sweep ...")`) it joins the job's cluster and its
Serve instance.

What it leaves behind: one `BenchResult` JSON (`--out`; every run carries its
SLO-goodput and cost, `afd_ray.bench.slo`) and a PNG beside it (`plot_sweep`). What it
prints: one machine-readable progress line per event (`afd_ray.bench.progress`) and,
at the end, the bench's table; on a terminal also a tqdm bar.

Cancelling (`JobSubmissionClient.stop_job`, which sends SIGTERM, or Ctrl-C): the
layout being deployed or measured is deleted from Serve (the delete is handed to the
Serve controller, which finishes it even if Ray kills this process a few seconds
later), a `cancelled` progress line is printed, and the process exits with status 130.
"""

from __future__ import annotations

import re
import signal
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from afd_ray.argtypes import check_writable
from afd_ray.bench.cli import RUN_FLAGS, SMOKE, build_parser, format_table, serve_endpoint, usage_message
from afd_ray.bench.commit import git_commit
from afd_ray.bench.compare import compare
from afd_ray.bench.config import MAX_RANKS, BenchConfig, Topology
from afd_ray.bench.progress import emit
from afd_ray.bench.schema import BenchResult

__all__ = ["layouts_from_ranges", "main", "parse_range", "plot_sweep", "run_sweep"]

_RANGE = re.compile(r"(\d+)-(\d+)")
CANCELLED_EXIT = 130


def parse_range(field: str, text: str) -> tuple[int, ...]:
    """`"2"` → (2,), `"1-3"` → (1, 2, 3), `"1,4"` → (1, 4).

    Raises:
        ValueError: not of those forms, empty, or a value below 1 or above
            `MAX_RANKS` (checked before a range is listed); names `field`.
    """
    text = text.strip()
    match = _RANGE.fullmatch(text)
    try:
        numbers = (int(match[1]), int(match[2])) if match else tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"{field}: {text!r} is not N, N-M or N,M,... (e.g. 1-2)") from None
    if not numbers or min(numbers) < 1 or max(numbers) > MAX_RANKS or (match and numbers[0] > numbers[1]):
        raise ValueError(f"{field}: {text!r} must name at least one rank count, each from 1 to {MAX_RANKS}")
    return tuple(range(numbers[0], numbers[1] + 1)) if match else numbers


def layouts_from_ranges(attention: str, ffn: str) -> tuple[Topology, ...]:
    """Every (A, F) of the two ranges, A outer, F inner.

    Raises:
        ValueError: a range does not parse; names `--attention` or `--ffn`.
    """
    return tuple(
        Topology(attention=a, ffn=f) for a in parse_range("--attention", attention) for f in parse_range("--ffn", ffn)
    )


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _delete_apps(names: Sequence[str]) -> list[str]:
    """Hand the deletion of those of `names` that Serve still runs to the Serve
    controller, without waiting; returns them."""
    from ray import serve

    running = [name for name in names if name in serve.status().applications]
    for name in running:
        serve.delete(name, _blocking=False)
    return running


def run_sweep(cfg: BenchConfig, base_url: str, commit: str | None = None) -> BenchResult:
    """Measure every (family, layout) of `cfg` one after another on the Serve instance
    at `base_url` (see `afd_ray.bench.runner.run_benchmark`, which runs each one),
    printing progress lines; `commit` is recorded (`BenchResult.commit`).

    Raises:
        KeyboardInterrupt: cancelled (SIGINT, or SIGTERM once `main` installed its
            handler); the application being measured was handed to Serve for deletion.
        The errors of `run_benchmark` (a failed request, counters that never settle).
    """
    from tqdm import tqdm

    from afd_ray.bench.runner import app_name, run_benchmark

    cases = [(family, topology) for family in cfg.families for topology in cfg.topologies]
    emit("start", total=len(cases), layouts=[f"{family} {t.label}" for family, t in cases])
    runs, last, transport = [], None, None
    try:
        for done, (family, topology) in enumerate(tqdm(cases, unit="layout", disable=None, file=sys.stderr)):
            emit("layout_start", done=done, total=len(cases), family=family, layout=topology.label)
            first = done == 0  # the transport microbenchmark, if asked for, runs once
            one = cfg.model_copy(
                update={
                    "families": (family,),
                    "topologies": (topology,),
                    "transport_microbench": cfg.transport_microbench and first,
                }
            )
            last = run_benchmark(one, base_url, progress=lambda _: None)
            transport = last.transport if first else transport
            (run,) = last.runs
            runs.append(run)
            emit(
                "layout_done",
                done=done + 1,
                total=len(cases),
                family=family,
                layout=topology.label,
                tok_s=run.output_tokens_per_s,
                goodput_rps=run.slo.goodput_rps,
                cost_per_1m=run.slo.cost_per_1m_output_tokens,
            )
    except BaseException as e:
        deleted = _delete_apps([app_name(family, topology) for family, topology in cases])
        emit("cancelled" if isinstance(e, KeyboardInterrupt) else "failed", error=repr(e), deleted=deleted)
        raise
    assert last is not None  # cases is not empty: BenchConfig needs a family and a layout
    return BenchResult(
        created=datetime.now(UTC).isoformat(timespec="seconds"),
        commit=commit,
        machine=last.machine,
        config=cfg,
        runs=runs,
        same_batch=compare(runs),
        transport=transport,
    )


def plot_sweep(result: BenchResult, path: Path) -> Path:
    """A PNG of tok/s, TPOT p90, TTFT p90, SLO-goodput and cost per 1M output tokens
    against the layout (one bar group per family); returns `path`.

    Raises:
        ValueError: a run has no SLO figures (`RunResult.slo` is None: a result written
            before they were recorded); names the runs.
    """
    missing = [f"{run.family} {run.label}" for run in result.runs if run.slo is None]
    if missing:
        raise ValueError(f"runs[].slo: {missing} have no SLO-goodput/cost figures to plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("output tok/s", lambda r: r.output_tokens_per_s),
        ("TPOT p90 (ms)", lambda r: r.tpot.p90_ms),
        ("TTFT p90 (ms)", lambda r: r.ttft.p90_ms),
        ("SLO-goodput (req/s)", lambda r: r.slo.goodput_rps),
        ("cost per 1M output tokens", lambda r: r.slo.cost_per_1m_output_tokens),
    ]
    families = list(dict.fromkeys(run.family for run in result.runs))
    labels = list(dict.fromkeys(run.label for run in result.runs))
    width = 0.8 / len(families)
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    for ax, (title, value) in zip(axes, panels, strict=True):
        for k, family in enumerate(families):
            runs = {run.label: run for run in result.runs if run.family == family}
            xs = [i + k * width for i, label in enumerate(labels) if label in runs]
            ax.bar(xs, [value(runs[label]) for label in labels if label in runs], width, label=family)
        ax.set_xticks([i + width * (len(families) - 1) / 2 for i in range(len(labels))], labels)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    cfg = result.config
    fig.suptitle(
        f"A:F sweep, SLO TTFT <= {cfg.slo_ttft_ms:g} ms, TPOT <= {cfg.slo_tpot_ms:g} ms, "
        f"{cfg.price_per_device_hour:g} per device-hour"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Run the sweep; `argv` defaults to `sys.argv[2:]` (after `sweep`). Returns 0,
    or `CANCELLED_EXIT` when cancelled.

    Bad flags (a layout spec, an SLO, any bench setting) exit with status 2 and a
    message naming the field.
    """
    parser = build_parser()
    parser.prog = "python -m afd_ray.bench sweep"
    parser.description = "Deploy A:F layouts one after another under one load; JSON + PNG."
    parser.add_argument("--attention", help="attention ranks: N, N-M or N,M,... (with --ffn)")
    parser.add_argument("--ffn", help="FFN ranks: N, N-M or N,M,... (with --attention)")
    args = vars(parser.parse_args(argv))
    out, ray_address, serve_url, smoke, commit = (args.pop(k) for k in RUN_FLAGS)
    commit = commit or git_commit()
    attention, ffn = args.pop("attention"), args.pop("ffn")
    try:
        if (attention is None) != (ffn is None):
            raise ValueError("--attention and --ffn: give both ranges, or neither and --topologies")
        if attention is not None:
            if "topologies" in args:
                raise ValueError("--topologies: give either a list of layouts or --attention/--ffn ranges")
            args["topologies"] = layouts_from_ranges(attention, ffn)
        elif "topologies" not in args:
            raise ValueError("--topologies: which layouts to sweep (or --attention and --ffn ranges)")
        smoke_settings = {k: v for k, v in SMOKE.items() if k != "topologies"} if smoke else {}
        # The sweep compares layouts, each deployed once; the transport microbenchmark only on request.
        cfg = BenchConfig.model_validate(smoke_settings | {"transport_microbench": False, "repeats": 1} | args)
        if len(cfg.concurrency) != 1:
            raise ValueError("--concurrency: the sweep sends one load to every layout; give one value")
        if cfg.repeats != 1:
            raise ValueError("--repeats: the sweep deploys each layout once; repeats are the bench's")
    except ValueError as e:
        parser.error(usage_message(e))
    try:
        check_writable(out)
    except ValueError as e:
        parser.error(str(e))

    try:
        with serve_endpoint(cfg, ray_address, serve_url) as url:
            # After connecting: `ray.init` installs its own SIGTERM handler (`sys.exit(15)`,
            # Ray 2.60), which would skip the cleanup. Before this nothing is deployed yet.
            signal.signal(signal.SIGTERM, _raise_interrupt)
            result = run_sweep(cfg, url, commit)
    except KeyboardInterrupt:
        print("afd_ray.bench sweep: cancelled", file=sys.stderr)
        return CANCELLED_EXIT
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(result.model_dump_json(indent=2) + "\n")
    plot = plot_sweep(result, out.with_suffix(".png"))
    print(format_table(result))
    emit("done", out=str(out), plots=[str(plot)])
    return 0
