"""Refusal latency under a burst, by Serve HTTP ingress: Serve's Python proxy, direct
ingress (the client on the ingress replica's own port), or HAProxy + direct ingress (what
`make serve` runs). docs/failures.md has the numbers (results/cpu-2026-12-07-refusal-burst.json).

    python benchmarks/refusal_burst.py MODE [--no-guarded] [--bursts K] [--out FILE]

MODE is `proxy`, `direct` or `haproxy`; it sets Ray's variables before this process
starts its own local cluster, so run the modes one after the other. Each mode deploys an
app that refuses every request at once (Serve's floor), then the guarded tiny app of
tests/serve/conftest.py (capacity 4), and sends K bursts of 20 streaming completions to
each, from 20 threads (as tests/serve/test_admission.py does) and from one asyncio loop.
Prints each burst's refusals (seconds to the response headers at the client: median,
p90, max) and a `RESULT` JSON line with every sample; with `--out`, also writes them to
FILE as JSON with the commit, the machine (`afd_ray.bench.runner.machine`), the load
average before and after, and median / p90 / max per kind in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

from afd_ray.argtypes import check_writable, positive_int

_parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
_parser.add_argument("mode", choices=("proxy", "direct", "haproxy"), help="the Serve HTTP ingress to measure")
_parser.add_argument("--no-guarded", action="store_true", help="only the app that refuses everything")
_parser.add_argument("--bursts", type=positive_int, default=5, help="bursts per kind (default: 5)")
_parser.add_argument("--out", type=Path, help="JSON results file to write")
_args = _parser.parse_args()
if _args.out is not None:
    try:
        check_writable(_args.out)
    except ValueError as e:
        _parser.error(str(e))
MODE, GUARDED, BURSTS, OUT = _args.mode, not _args.no_guarded, _args.bursts, _args.out
if MODE in ("direct", "haproxy"):
    os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "1"
if MODE == "haproxy":
    os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
os.environ["RAY_AUTH_MODE"] = "disabled"
N = 20

import httpx  # noqa: E402
import ray  # noqa: E402
from fastapi import FastAPI  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402
from ray import serve  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "serve"))

refuse_app = FastAPI()


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(refuse_app)
class Refuse:
    @refuse_app.post("/v1/completions")
    async def completions(self) -> JSONResponse:
        return JSONResponse({"error": "busy"}, status_code=429, headers={"Retry-After": "2"})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def burst(url: str, headers: dict, body: dict, n: int) -> list[tuple[int, float]]:
    out: list[tuple[int, float]] = []
    start = threading.Barrier(n + 1)

    def send(http: httpx.Client) -> None:
        start.wait(60)
        sent = time.monotonic()
        with http.stream("POST", url, json=body, headers=headers, timeout=120) as r:
            t = time.monotonic() - sent
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    json.loads(line.removeprefix("data: "))
        out.append((r.status_code, t))

    with httpx.Client(timeout=120) as http:
        threads = [threading.Thread(target=send, args=(http,)) for _ in range(n)]
        for t in threads:
            t.start()
        start.wait(60)
        for t in threads:
            t.join(180)
    return out


def aburst(url: str, headers: dict, body: dict, n: int) -> list[tuple[int, float]]:
    """The same burst from one asyncio event loop (httpx.AsyncClient), no threads."""
    import asyncio

    async def send(http: "httpx.AsyncClient") -> tuple[int, float]:
        sent = time.monotonic()
        async with http.stream("POST", url, json=body, headers=headers, timeout=120) as r:
            t = time.monotonic() - sent
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    json.loads(line.removeprefix("data: "))
        return r.status_code, t

    async def main() -> list[tuple[int, float]]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as http:
            return list(await asyncio.gather(*(send(http) for _ in range(n))))

    return asyncio.run(main())


def summary_ms(xs: list[float]) -> dict[str, float]:
    """Median, 90th percentile (nearest rank below) and max of `xs` seconds, in ms."""
    xs = sorted(xs)
    return {
        "n": len(xs),
        "median_ms": round(statistics.median(xs) * 1e3, 1),
        "p90_ms": round(xs[int(0.9 * (len(xs) - 1))] * 1e3, 1),
        "max_ms": round(xs[-1] * 1e3, 1),
    }


def stats(xs: list[float]) -> str:
    s = summary_ms(xs)
    return f"n={s['n']} median={s['median_ms']:.0f} p90={s['p90_ms']:.0f} max={s['max_ms']:.0f} ms"


def base_of(app: str, proxy_port: int) -> str:
    if MODE != "direct":
        return f"http://127.0.0.1:{proxy_port}"
    client = serve.context._get_global_client()
    for _ in range(200):
        groups = ray.get(client._controller.get_target_groups.remote(app))
        for g in groups:
            if str(g.protocol).endswith("HTTP") and g.targets and g.targets[0].port != proxy_port:
                return f"http://127.0.0.1:{g.targets[0].port}"
        time.sleep(0.1)
    raise RuntimeError(f"no direct target for {app}: {groups}")


def main() -> None:
    load_before = os.getloadavg()
    print(f"mode={MODE} load={load_before}", flush=True)
    ray.init(address="local", include_dashboard=False, num_cpus=8)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(Refuse.bind(), name="refuse", route_prefix="/refuse")
    results: dict[str, list[float]] = {}
    base = base_of("refuse", port)
    print("refuse at", base, flush=True)
    httpx.post(f"{base}/refuse/v1/completions", json={})
    for _ in range(BURSTS):
        time.sleep(0.5)
        answers = burst(f"{base}/refuse/v1/completions", {}, {}, N)
        assert all(s == 429 for s, _ in answers), answers
        results.setdefault("trivial", []).extend(t for _, t in answers)
    print("trivial:", stats(results["trivial"]), flush=True)
    if GUARDED:
        from guarded_app import API_KEY, ADMIN_KEY, USER  # noqa: F401

        from afd_ray.models.tiny import build_tiny
        from afd_ray.serve.app import build_app

        from pathlib import Path

        checkpoint = build_tiny("llama", Path(f"/tmp/refusal-bench-{os.getpid()}/llama"))
        os.environ["AFD_TEST_API_KEY"] = API_KEY
        os.environ["AFD_TEST_ADMIN_KEY"] = ADMIN_KEY
        args = {
            "model": {"source": str(checkpoint), "served_name": "tiny", "max_model_len": 512},
            "ingress": {
                "max_ongoing_requests": 64,
                "max_queued_per_rank": 2,
                "retry_after_s": 2,
                "body_timeout_s": 3.0,
                "api_key_env": "AFD_TEST_API_KEY",
                "admin_key_env": "AFD_TEST_ADMIN_KEY",
            },
            "attention": {"num_ranks": 1, "kv_cache_gib": 0.125, "max_num_seqs": 2, "bundle_resources": 0.5},
            "ffn": {"num_ranks": 1, "bundle_resources": 0.5},
        }
        t0 = time.monotonic()
        serve.run(build_app(args), name="guarded", route_prefix="/guarded", external_scaler_enabled=True)
        print(f"guarded up in {time.monotonic() - t0:.0f} s", flush=True)
        base = base_of("guarded", port) + "/guarded"
        body = {
            "model": "tiny",
            "prompt": "The quick brown fox",
            "max_tokens": 24,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        assert (
            httpx.post(f"{base}/v1/completions", json=body | {"stream": False}, headers=USER, timeout=120).status_code
            == 200
        )
        for _ in range(BURSTS):
            while httpx.get(f"{base}/afd/status").json()["admission"]["in_flight"]:
                time.sleep(0.05)
            for kind, fn in (("threads", burst), ("asyncio", aburst)):
                while httpx.get(f"{base}/afd/status").json()["admission"]["in_flight"]:
                    time.sleep(0.05)
                answers = fn(f"{base}/v1/completions", USER, body, N)
                assert {s for s, _ in answers} <= {200, 429}, answers
                refused = [t for s, t in answers if s == 429]
                print(f"  {kind} burst: {len(answers) - len(refused)} ok, {stats(refused)}", flush=True)
                results.setdefault(f"guarded-{kind}", []).extend(refused)
        for kind in ("threads", "asyncio"):
            print(f"guarded {kind}:", stats(results[f"guarded-{kind}"]), flush=True)
    print(f"load after={os.getloadavg()}", flush=True)
    print("RESULT", json.dumps({"mode": MODE, **{k: sorted(v) for k, v in results.items()}}), flush=True)
    if OUT:
        from afd_ray.bench.commit import git_commit
        from afd_ray.bench.runner import machine

        record = {
            "what": "benchmarks/refusal_burst.py: seconds from sending to the response headers of the "
            f"refused requests in bursts of {N} streaming completions",
            "commit": git_commit(),
            "mode": MODE,
            "bursts": BURSTS,
            "machine": machine().model_dump(),
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_average_1m": [load_before[0], os.getloadavg()[0]],
            "refusals": {k: summary_ms(v) for k, v in results.items()},
            "samples_s": {k: sorted(v) for k, v in results.items()},
        }
        with open(OUT, "w") as f:
            json.dump(record, f, indent=1)
        print(f"{'kind':16} {'n':>4} {'median ms':>10} {'p90 ms':>8} {'max ms':>8}")
        for kind, s in record["refusals"].items():
            print(f"{kind:16} {s['n']:>4} {s['median_ms']:>10} {s['p90_ms']:>8} {s['max_ms']:>8}")
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
