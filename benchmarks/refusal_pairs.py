"""Three alternating pairs of `refusal_burst.py` (haproxy, proxy; proxy, haproxy;
haproxy, proxy), each run its own process and local Ray cluster, merged into one
results file: every run's record and, per mode and kind, the median of the runs'
median refusals with their range. `results/cpu-2026-12-07-refusal-burst.json` was
made this way (the loop then ran from a shell, the merge as this file's `merge`).

    python benchmarks/refusal_pairs.py OUT.json [--bursts K]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from afd_ray.argtypes import check_writable, positive_int

PAIRS = (("haproxy", "proxy"), ("proxy", "haproxy"), ("haproxy", "proxy"))
KINDS = ("trivial", "guarded-threads", "guarded-asyncio")


def merge(runs: list[dict]) -> dict:
    """One results file from `refusal_burst.py --out` records of one commit.

    Raises:
        ValueError: the records come from more than one commit.
    """
    commits = {r["commit"] for r in runs}
    if len(commits) != 1:
        raise ValueError(f"runs of several commits: {sorted(commits)}")
    summary = {}
    for mode in dict.fromkeys(r["mode"] for r in runs):
        summary[mode] = {}
        for kind in KINDS:
            medians = [r["refusals"][kind]["median_ms"] for r in runs if r["mode"] == mode]
            summary[mode][kind] = {
                "median_ms_per_run": medians,
                "median_of_medians_ms": statistics.median(medians),
                "spread_ms": [min(medians), max(medians)],
                "p90_ms_per_run": [r["refusals"][kind]["p90_ms"] for r in runs if r["mode"] == mode],
            }
    return {
        "what": "benchmarks/refusal_burst.py, alternating pairs: seconds from sending to the response headers of "
        "refused streaming completions, bursts of 20. haproxy: HAProxy + direct ingress, what `make serve` runs; "
        "proxy: Serve's Python HTTP proxy, Ray's default. trivial: an app that refuses every request (Serve's "
        "floor); guarded-*: the tiny Llama AFD app of tests/serve/conftest.py (capacity 4), from 20 threads or "
        "one asyncio loop",
        "commit": commits.pop(),
        "machine": runs[0]["machine"],
        "summary": summary,
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the merged results file")
    parser.add_argument("--bursts", type=positive_int, default=5, help="bursts per run and kind (default: 5)")
    args = parser.parse_args()
    try:
        check_writable(args.out, "out")
    except ValueError as e:
        parser.error(str(e))
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair, modes in enumerate(PAIRS, 1):
            for mode in modes:
                path = Path(tmp) / f"{mode}-{pair}.json"
                script = Path(__file__).with_name("refusal_burst.py")
                command = [sys.executable, str(script), mode, "--bursts", str(args.bursts), "--out", str(path)]
                subprocess.run(command, check=True, stdout=subprocess.DEVNULL, timeout=900)
                runs.append(json.loads(path.read_text()) | {"pair": pair})
    result = merge(runs)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{'mode':8} {'kind':16} {'median of medians ms':>21} {'range ms':>14}")
    for mode, kinds in result["summary"].items():
        for kind, s in kinds.items():
            print(f"{mode:8} {kind:16} {s['median_of_medians_ms']:>21} {str(s['spread_ms']):>14}")


if __name__ == "__main__":
    main()
