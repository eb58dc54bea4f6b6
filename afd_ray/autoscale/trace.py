"""Metrics traces: JSON Lines of `MetricsSnapshot`, one per evaluation.

`record` polls a live application's `GET /afd/status` and appends its `metrics`;
`read_trace` loads a trace for `afd_ray.autoscale.simulate.replay`.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from pydantic import ValidationError

from afd_ray.autoscale.schema import MetricsSnapshot

__all__ = ["read_trace", "record"]


def record(url: str, out: Path, interval_s: float, duration_s: float) -> int:
    """Write one `MetricsSnapshot` JSON line to `out` every `interval_s` seconds for
    `duration_s` seconds, from the `metrics` of `GET {url}/afd/status`.

    Returns the number of lines written.

    Raises:
        httpx.HTTPError: the application did not answer, or answered an error status.
        ValueError: its status has no `metrics` (a coordinator without signals).
    """
    written = 0
    start = time.monotonic()
    with httpx.Client(base_url=url, timeout=30) as http, out.open("w") as lines:
        while True:
            # Polls are on a fixed schedule (start + k * interval_s), so a slow answer
            # delays one line but never drops one: floor(duration_s / interval_s) + 1 lines.
            time.sleep(max(start + written * interval_s - time.monotonic(), 0.0))
            response = http.get("/afd/status")
            response.raise_for_status()
            metrics = response.json().get("metrics")
            if metrics is None:
                raise ValueError(f"{url}/afd/status has no 'metrics'")
            lines.write(MetricsSnapshot.model_validate(metrics).model_dump_json() + "\n")
            lines.flush()
            written += 1
            if written * interval_s > duration_s:
                return written


def read_trace(path: Path) -> list[MetricsSnapshot]:
    """The snapshots of a trace file, in file order (blank lines skipped).

    Raises:
        ValueError: a line is not a valid `MetricsSnapshot`, or the file has none; the
            message names the line number and the field.
        OSError: the file cannot be read.
    """
    snapshots = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            snapshots.append(MetricsSnapshot.model_validate_json(line))
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or '<line>'}: {err['msg']}" for err in e.errors())
            raise ValueError(f"{path}:{number}: {problems}") from e
    if not snapshots:
        raise ValueError(f"{path}: no snapshots")
    return snapshots
