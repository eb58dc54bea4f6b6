"""A real Prometheus server for tests: Debian's `prometheus` package (`make test`
installs it), scraping a Ray cluster through Ray's own file service-discovery list.

`Prometheus(sd_file, folder)` writes a config whose only job reads `sd_file`, starts
`prometheus` on a free loopback port with its TSDB in `folder`, and waits (bounded)
until it is ready; `close()` always ends the process, and the kernel ends it with its
parent should the test process die without cleaning up. Queries go through
Prometheus's HTTP API (`/api/v1/query_range`).
"""

from __future__ import annotations

import ctypes
import math
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import ray
from ray._private.metrics_agent import PrometheusServiceDiscoveryWriter

from ports import free_port

__all__ = ["Prometheus", "write_ray_service_discovery"]

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0


def write_ray_service_discovery() -> Path:
    """Ray's file service-discovery list of the connected cluster's metrics endpoints,
    `<session dir>/prom_metrics_service_discovery.json`, written by Ray's own writer.

    Ray's dashboard head rewrites that file every 5 s; the test session's cluster runs
    without a dashboard (`include_dashboard=False`), so the same writer writes it once
    here (the node's metrics export port is fixed for the session). `temp_dir` is the
    session dir too, so no `/tmp/ray` link of another cluster is replaced.
    """
    session = ray._private.worker._global_node.get_session_dir_path()
    writer = PrometheusServiceDiscoveryWriter(ray.get_runtime_context().gcs_address, session, session)
    writer.write()
    return Path(writer.get_target_file_name())


def _die_with_parent() -> None:
    """In the child: SIGTERM when the parent dies (Linux `prctl(PR_SET_PDEATHSIG)`)."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


class Prometheus:
    """One `prometheus` process scraping the targets listed in `sd_file` every
    `scrape_interval_s`, its config, TSDB and log in `folder`.

    Raises:
        FileNotFoundError: no `prometheus` on PATH (`make test` installs Debian's).
        TimeoutError: not ready within `READY_TIMEOUT_S` (the process is ended).
        RuntimeError: it exited at start-up (its log is in the message).
    """

    def __init__(self, sd_file: Path, folder: Path, scrape_interval_s: int = 3) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise FileNotFoundError(
                "prometheus is not on PATH: `make test` installs Debian's package (apt-get install prometheus)"
            )
        config = folder / "prometheus.yml"
        config.write_text(
            "global:\n"
            f"  scrape_interval: {scrape_interval_s}s\n"
            f"  scrape_timeout: {scrape_interval_s}s\n"
            "scrape_configs:\n"
            "  - job_name: ray\n"
            "    file_sd_configs:\n"
            f"      - files: ['{sd_file}']\n"
            "        refresh_interval: 5s\n"
        )
        self.url = f"http://127.0.0.1:{free_port()}"
        self.started = time.time()
        """Start of the process, Unix seconds (the first possible sample)."""
        self._log = folder / "prometheus.log"
        with self._log.open("wb") as log:
            self._process = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={folder / 'data'}",
                    f"--web.listen-address={self.url.removeprefix('http://')}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        self._http = httpx.Client(base_url=self.url, timeout=30)
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self._process.returncode}: {self.log()}")
            try:
                if self._http.get("/-/ready").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"prometheus not ready after {READY_TIMEOUT_S} s: {self.log()}")

    def log(self) -> str:
        """The last 4000 characters of the server's log."""
        return self._log.read_text(errors="replace")[-4000:]

    def targets(self) -> list[dict]:
        """The active scrape targets (`scrapeUrl`, `health`, `lastError`, ...)."""
        return self._get("/api/v1/targets")["activeTargets"]

    def nonzero_series(self, expr: str, start: float, end: float, step_s: float) -> list[dict[str, str]]:
        """Label sets of the series of the range query `expr` over `[start, end]`
        (Unix seconds) that have at least one value that is neither 0 nor NaN.

        Raises:
            RuntimeError: Prometheus rejected the query (its error is in the message).
        """
        data = self._get("/api/v1/query_range", query=expr, start=start, end=end, step=step_s)
        return [
            series["metric"]
            for series in data["result"]
            if any(not math.isnan(v) and v != 0 for v in (float(value) for _, value in series["values"]))
        ]

    def _get(self, path: str, **params: object) -> dict:
        body = self._http.get(path, params=params).json()
        if body["status"] != "success":
            raise RuntimeError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def close(self) -> None:
        """End the process (SIGTERM, then SIGKILL after `STOP_TIMEOUT_S`)."""
        self._http.close()
        self._process.terminate()
        try:
            self._process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(STOP_TIMEOUT_S)
