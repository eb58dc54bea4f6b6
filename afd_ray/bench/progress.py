"""Machine-readable progress lines of a sweep, and a tqdm bar that follows them.

A sweep running as a Ray job prints one line per event on stdout:

    afd_ray.progress {"event": "layout_done", "done": 2, "total": 3, "layout": "2A1F", ...}

`event` is `start` (`total` layouts), `layout_start`, `layout_done` (with the run's
`tok_s`, `goodput_rps`, `cost_per_1m`), `done` (with `out` and `plots`), `cancelled`
or `failed` (with `error`). Everything after the prefix is one JSON object. Anyone
reading the job's log (`JobSubmissionClient.get_job_logs`) can parse them with
`parse_progress`; `follow_job` does so and draws a tqdm bar.
"""

from __future__ import annotations

import json
import time

__all__ = ["PREFIX", "emit", "follow_job", "parse_progress"]

PREFIX = "afd_ray.progress "


def emit(event: str, **fields: object) -> None:
    """Print one progress line (flushed, so a job log shows it at once)."""
    print(PREFIX + json.dumps({"event": event} | fields), flush=True)


def parse_progress(log: str) -> list[dict[str, object]]:
    """Every progress event in `log` (a job's whole log so far), in order; other
    lines are ignored."""
    return [json.loads(line[len(PREFIX) :]) for line in log.splitlines() if line.startswith(PREFIX)]


def follow_job(client: object, job_id: str, poll_s: float = 2.0, timeout_s: float = 3600.0) -> str:
    """Follow a sweep job's progress lines with a tqdm bar (one step per layout) until
    the job ends; returns its final status (`SUCCEEDED`, `FAILED` or `STOPPED`).

    Args:
        client: a `ray.job_submission.JobSubmissionClient`.
        job_id: the submission id `submit_job` returned.
        poll_s: seconds between two reads of the job's status and log.
        timeout_s: bound on the whole wait, seconds.

    Raises:
        TimeoutError: the job did not end within `timeout_s`.
    """
    from tqdm.auto import tqdm

    seen = 0
    deadline = time.monotonic() + timeout_s
    with tqdm(total=None, unit="layout", desc=job_id) as bar:
        while True:
            status = client.get_job_status(job_id)
            events = parse_progress(client.get_job_logs(job_id))
            for event in events[seen:]:
                _show(bar, event)
            seen = len(events)
            if status.is_terminal():
                return str(status.value)
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id}: still {status.value} after {timeout_s:.0f} s")
            time.sleep(poll_s)


def _show(bar: object, event: dict[str, object]) -> None:
    if event["event"] == "start":
        bar.reset(total=event["total"])
    elif event["event"] == "layout_start":
        bar.set_postfix_str(f"deploying {event['layout']}")
    elif event["event"] == "layout_done":
        bar.update(1)
        bar.set_postfix_str(f"{event['layout']}: {event['tok_s']:.1f} tok/s")
