"""Pools across Ray nodes: a two-node cluster on one machine (head 127.0.0.1, worker
127.0.0.2 with a custom resource), the FFN pool pinned to the worker through
`AFDConfig`. The FFN replica runs there, the pair picks the cross-node transport
(gloo), and greedy float32 tokens equal plain vLLM's. The ingress replica runs on the
head node (`ingress.placement: head`, the default), next to HAProxy, which passes the
requests straight to it, not through its backup Serve proxy.

The cluster runs under a driver subprocess (`two_node_driver.py`), since this
process is already connected to the session's cluster; plain vLLM runs here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vllm import SamplingParams

from afd_ray.models.tiny import build_tiny
from afd_ray.serve.ingress_env import private_cluster_env
from plain_engine import plain_llm

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 12
DRIVER = Path(__file__).with_name("two_node_driver.py")


@contextmanager
def _driver(checkpoint: str) -> Iterator[tuple[subprocess.Popen, Path]]:
    """Starts the driver (its output goes to the yielded log file) in a new process
    group with its own Ray temp dir, and kills the group on the way out (the driver's
    Ray nodes included) whatever happened.

    - `RAY_TMPDIR`: the cluster's sessions, sockets and `ray_current_cluster` file
      stay out of `/tmp/ray`, where the session cluster and `ray start` keep theirs.
      Short, under /tmp: Unix socket paths are limited to 107 bytes.
    - Serve's ingress as the session's (`private_cluster_env`), with its own free ports
      for HAProxy's extra listeners (the session cluster's HAProxy holds its own).
    - `RAY_ADDRESS` is dropped, so the driver cannot join another cluster.
    - `PYTHONPATH`: the repository (`afd_ray`) and `tests/` (the `ports` helper).
    - `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`: without it, `ray.init` rewrites the
      head's 127.0.0.1 to this machine's network IP, where the head's GCS does not
      listen (Ray 2.60, `services.resolve_ip_for_localhost`); with it, loopback
      addresses stay as given. The nodes still get the explicit IPs of the driver.
    """
    with tempfile.TemporaryDirectory(prefix="afd2n-", dir="/tmp") as ray_tmp:
        env = (
            {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
            | {
                "RAY_AUTH_MODE": "disabled",
                "RAY_TMPDIR": ray_tmp,
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                "PYTHONPATH": os.pathsep.join((str(Path(__file__).parents[2]), str(Path(__file__).parents[1]))),
            }
            | private_cluster_env()
        )
        log = Path(ray_tmp) / "driver.log"  # a file, not a pipe: nobody reads while plain vLLM runs
        with log.open("w") as out:
            driver = subprocess.Popen(
                [sys.executable, str(DRIVER), checkpoint, json.dumps(PROMPTS), str(MAX_TOKENS)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            yield driver, log
        finally:
            try:
                os.killpg(driver.pid, signal.SIGKILL)  # the group's id is the driver's pid
            except ProcessLookupError:
                pass
            driver.wait()


def _result(driver: subprocess.Popen, log: Path) -> dict[str, object]:
    """The driver's RESULT line, once it exited (at most 10 minutes)."""
    driver.wait(timeout=600)
    output = log.read_text()
    lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
    assert driver.returncode == 0 and lines, output[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def _plain_vllm(checkpoint: str) -> list[list[int]]:
    """Greedy ids of plain vLLM for `PROMPTS`; the engine runs in this process
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: no EngineCore child re-importing vLLM beside
    the starting cluster) and is shut down before returning."""
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with plain_llm(checkpoint, 256, 1 << 28) as llm:
        return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, greedy, use_tqdm=False)]


def test_ffn_pool_pinned_to_a_second_node_serves_over_gloo(tmp_path: Path) -> None:
    checkpoint = str(build_tiny("llama", tmp_path / "llama"))
    with _driver(checkpoint) as (driver, log):
        expected = _plain_vllm(checkpoint)  # while the cluster starts
        result = _result(driver, log)

    assert result["worker_node"] != result["head_node"]
    assert result["ffn_nodes"] == [result["worker_node"]]  # pinned through ffn.placement
    assert result["ffn_hosts"] == ["127.0.0.2"]  # connector.host unset: the worker node's IP
    assert result["transports"] == {"0": "gloo"}  # attention on the head: cross-node transport
    assert result["tokens"] == expected

    # The ingress replica binds 127.0.0.1 on its own node: only on the head does HAProxy
    # reach it. Before `ingress.placement` it landed on the worker, HAProxy marked its
    # server DOWN and every request went through the backup Serve proxy (the slow path).
    assert result["ingress_nodes"] == [result["head_node"]]
    servers = result["haproxy_servers"]
    direct = [server for server in servers if not server["backup"]]
    backup = [server for server in servers if server["backup"]]
    assert len(direct) >= 1 and len(backup) >= 1, servers
    assert all(server["status"] == "UP" for server in direct), servers
    # every request (the prompts and /afd/status) went to the replica's own server
    assert sum(server["sessions"] for server in direct) >= len(PROMPTS) + 1, servers
    assert sum(server["sessions"] for server in backup) == 0, servers
