"""Driver of `test_two_nodes.py`, in its own process (a Ray driver joins one cluster,
and the test session already holds one).

Starts a two-node Ray cluster on this machine: a head on 127.0.0.1 and a worker node
on 127.0.0.2 that alone has the custom resource `ffn_node`. Serves the tiny Llama
checkpoint given as argv[1] with the FFN pool pinned to `ffn_node` through
`AFDConfig` (`ffn.placement.resources`) and `connector.host` unset, sends the prompts
of argv[2] (a JSON list) as greedy completions of argv[3] tokens through HAProxy, and
prints one JSON line: the token ids, the Ray node of each FFN rank, of each ingress
replica, of the head and of the worker node, the host the FFN rank bound, the
transport of each attention↔FFN pair, and HAProxy's servers of the application
(state and sessions served, from its stats page): the ingress replicas' own HTTP
servers (direct ingress) and the backup Serve proxy.

Every port is picked by the OS (GCS, node managers, agents, the Serve proxy); the
caller gives this process its own `RAY_TMPDIR` and process group, so nothing here
meets the session cluster, and a killed driver takes its Ray processes with it.
"""

from __future__ import annotations

import csv
import json
import os
import sys
import time

import httpx
import ray
from ray import serve
from ray.cluster_utils import Cluster

from afd_ray.serve.app import build_app
from ports import free_port


_DIRECT_UP_S = 60.0
"""How long the driver waits for HAProxy to mark an ingress replica's server UP
before it sends the prompts anyway (the result then shows it DOWN), seconds."""


def _haproxy_servers(app: str) -> list[dict[str, object]]:
    """The servers of `app`'s HTTP backends in HAProxy's stats (CSV of the stats page,
    `RAY_SERVE_HAPROXY_STATS_PORT`): name, `backup` (the fallback Serve proxy; else an
    ingress replica's own server), `status` (UP, DOWN, ...) and `sessions` (HAProxy's
    `stot`: connections it passed to that server)."""
    url = f"http://127.0.0.1:{os.environ['RAY_SERVE_HAPROXY_STATS_PORT']}/stats;csv"
    rows = csv.DictReader(httpx.get(url, timeout=10).raise_for_status().text.removeprefix("# ").splitlines())
    return [
        {
            "backend": row["pxname"],
            "server": row["svname"],
            "backup": row["bck"] == "1",
            "status": row["status"],
            "sessions": int(row["stot"]),
        }
        for row in rows
        if row["pxname"].startswith(f"http-{app}") and row["svname"] not in ("FRONTEND", "BACKEND")
    ]


def _wait_direct_up(app: str) -> None:
    """Until HAProxy marks an ingress replica's own server of `app` UP (its health
    check passed), at most `_DIRECT_UP_S`."""
    deadline = time.monotonic() + _DIRECT_UP_S
    while time.monotonic() < deadline:
        if any(not s["backup"] and s["status"] == "UP" for s in _haproxy_servers(app)):
            return
        time.sleep(0.5)


def _replica_nodes(app: str, deployment: str) -> list[str]:
    """Ray node ids of `deployment`'s replicas, from the Serve controller's instance
    details (what `serve status` and the dashboard show)."""
    controller = serve.context._get_global_client()._controller
    details = ray.get(controller.get_serve_instance_details.remote())
    return [replica["node_id"] for replica in details["applications"][app]["deployments"][deployment]["replicas"]]


def main(checkpoint: str, prompts: list[str], max_tokens: int) -> dict[str, object]:
    head = {"node_ip_address": "127.0.0.1", "num_cpus": 3, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=head | {"dashboard_agent_listen_port": None})
    try:
        worker = cluster.add_node(node_ip_address="127.0.0.2", num_cpus=1, resources={"ffn_node": 1})
        cluster.connect()
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port, "location": "HeadOnly"})
        args = {
            "model": {"source": checkpoint, "served_name": "tiny", "max_model_len": 256},
            "attention": {"bundle_resources": 0.5, "kv_cache_gib": 0.25, "max_num_seqs": 4},
            "ffn": {"bundle_resources": 0.5, "placement": {"resources": {"ffn_node": 1}}},
        }
        serve.run(build_app(args), name="afd", route_prefix="/")
        _wait_direct_up("afd")
        tokens = []
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=300) as http:
            for prompt in prompts:
                body = {
                    "model": "tiny",
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "return_token_ids": True,
                    "ignore_eos": True,
                }
                response = http.post("/v1/completions", json=body).raise_for_status()
                tokens.append(response.json()["choices"][0]["token_ids"])
            status = http.get("/afd/status").raise_for_status().json()
        transports = serve.get_deployment_handle("ffn", app_name="afd").peer_transports.remote().result()
        result = {
            "tokens": tokens,
            "ffn_nodes": [member["address"]["node"] for member in status["ffn"]],
            "ffn_hosts": [member["address"]["host"] for member in status["ffn"]],
            "ingress_nodes": _replica_nodes("afd", "ingress"),
            "haproxy_servers": _haproxy_servers("afd"),
            "worker_node": worker.node_id,
            "head_node": cluster.head_node.node_id,
            "transports": {str(peer): transport for peer, transport in transports.items()},
        }
        # No `serve.shutdown()`: it stops every replica gracefully (the ingress alone stays
        # 5 s), and the cluster's processes are killed right after anyway (the caller then
        # kills this process group too).
        return result
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]))))
