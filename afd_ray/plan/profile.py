"""`afd-ray profile` on CPU: split a decode step into attention, FFN/MoE and the rest
per batch size and context, measure plain vLLM's step given every core, and say
whether AFD pays against it.

Two engines, each in a process of its own (`afd_ray.plan.probe`, which gives the
profiler), one after the other:

- the split: plain vLLM with `threads` OpenMP threads (default 1, as one attention
  rank and one FFN rank run), the attention and FFN modules timed by forward hooks;
- plain vLLM at equal resources: the same engine with `plain_threads` threads
  (default: every core this process may use), its decode step timed the same way, as
  the benchmark's plain engine (`afd_ray.bench.plain`) would run on this machine.

Both in wall time (`afd_ray.plan.probe` says why). What serving through the app adds
to every step (HTTP streaming, the Serve replicas on the same cores) is measured
through the app itself (`afd_ray.plan.serving`: plain vLLM served by the benchmark at
the same batches) and given here as `serving`.

Communication inside a colocated step is zero on one device. What AFD would add is
measured separately (`afd_ray.plan.link`): the connector's layer round trip on this
machine, fitted to a latency and a bandwidth.

Verdict per profiled point (`verdicts`): AFD 1A:1F (its two ranks on the cores plain
vLLM used; CUDA: two GPUs) predicted by `afd_ray.plan.model`, against plain vLLM on
the same cores (measured; CUDA: DP+EP over the same two GPUs, modelled), same batch.
AFD pays when its output tok/s per core or GPU is higher.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from afd_ray.plan.schema import Link, PlainPoint, Profile, ServingPoint, StepPoint, Verdict

__all__ = ["check_inputs", "load_profile", "profile_vllm", "run_probe", "verdicts"]

PROBE_TIMEOUT_S = 900.0
"""Longest one profiling engine may take, start and all points (a 135M model at
batch 16 and 512-token prompts takes about a minute on 2 cores)."""


def run_probe(
    checkpoint: Path, threads: int, batches: Sequence[int], prompt_tokens: Sequence[int], decode_steps: int, dtype: str
) -> list[dict[str, float]]:
    """Run `afd_ray.plan.probe.measure` in a new process whose engine environment is
    `engine_env` with `threads` threads; return its points.

    Raises:
        RuntimeError: the probe failed (its stderr's tail in the message).
        subprocess.TimeoutExpired: it ran past `PROBE_TIMEOUT_S`.
    """
    from afd_ray.attention.engine import engine_env
    from afd_ray.config import AttentionPoolConfig

    env = os.environ | engine_env(AttentionPoolConfig(num_threads=threads)) | {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    spec = {
        "checkpoint": str(checkpoint),
        "batches": list(batches),
        "prompt_tokens": list(prompt_tokens),
        "decode_steps": decode_steps,
        "dtype": dtype,
    }
    with tempfile.TemporaryDirectory() as folder:
        spec_path, out_path = Path(folder) / "spec.json", Path(folder) / "out.json"
        spec_path.write_text(json.dumps(spec))
        done = subprocess.run(
            [sys.executable, "-m", "afd_ray.plan.probe", str(spec_path), str(out_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise RuntimeError(f"profiling engine ({threads} threads) failed: {done.stderr[-3000:]}")
        return json.loads(out_path.read_text())


def profile_vllm(
    checkpoint: Path,
    batches: Sequence[int],
    prompt_tokens: Sequence[int],
    decode_steps: int = 16,
    threads: int = 1,
    plain_threads: int | None = None,
    dtype: str = "float32",
    link: Link | None = None,
    serving: Sequence[ServingPoint] = (),
) -> Profile:
    """Profile `checkpoint` on this CPU (module docstring): the split with `threads`
    threads, plain vLLM with `plain_threads` (None: every usable core).

    Args:
        link: the A2F/F2A link; None measures the connector here (`shm`, `measure_link`).
        serving: plain vLLM with `plain_threads` threads through the Serve app at two or
            more batches (`afd_ray.plan.serving.measure_serving`); empty: not measured.

    Raises:
        ValueError: fewer than two distinct `batches`, an empty `prompt_tokens`, a
            batch above `afd_ray.plan.plan.MAX_BATCH`; no decoder layers found.
        RuntimeError: a profiling engine failed, or too few decode steps were timed.
    """
    import torch

    from afd_ray.plan.link import measure_link

    check_inputs(batches, prompt_tokens)
    plain_threads = plain_threads or len(os.sched_getaffinity(0))
    config = json.loads((checkpoint / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    torch_dtype = getattr(torch, dtype)
    link = link or measure_link(hidden, torch_dtype)
    split = run_probe(checkpoint, threads, batches, prompt_tokens, decode_steps, dtype)
    plain = run_probe(checkpoint, plain_threads, batches, prompt_tokens, decode_steps, dtype)
    moe = any(key in config for key in ("num_experts", "num_local_experts", "n_routed_experts"))
    profile = Profile(
        model=str(checkpoint),
        device=f"{_cpu_model()} ({threads} thread{'s' * (threads > 1)}; plain vLLM {plain_threads})",
        source="afd-ray profile: vLLM (own process, eager) + torch forward hooks (wall time, medians)"
        + ("; serving: plain vLLM through the Serve app (afd_ray.bench, TPOT p50)" if serving else ""),
        platform="cpu",
        num_layers=layers,
        hidden_size=hidden,
        bytes_per_elem=torch_dtype.itemsize,
        moe=moe,
        points=[
            StepPoint(
                batch=p["batch"],
                context=p["context"],
                step_ms=p["step_ms"],
                attention_ms=p["attention_ms"],
                ffn_ms=p["ffn_ms"],
            )
            for p in split
        ],
        plain=[PlainPoint(batch=p["batch"], context=p["context"], step_ms=p["step_ms"]) for p in plain],
        plain_devices=plain_threads,
        link=link,
        serving=list(serving),
    )
    return profile.model_copy(update={"verdicts": verdicts(profile)})


def check_inputs(batches: Sequence[int], prompt_tokens: Sequence[int]) -> None:
    """Refuse a profile before any engine or deployment starts.

    Raises:
        ValueError: fewer than two distinct `batches`, an empty `prompt_tokens`, a
            batch above `afd_ray.plan.plan.MAX_BATCH`.
    """
    from afd_ray.plan.plan import MAX_BATCH

    if len(set(batches)) < 2 or not prompt_tokens:
        raise ValueError("batches, prompt_tokens: at least two distinct batch sizes and one prompt length")
    if max(batches) > MAX_BATCH:
        raise ValueError(f"batches: each at most {MAX_BATCH} (MAX_BATCH), got {max(batches)}")


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


def verdicts(profile: Profile) -> list[Verdict]:
    """Whether AFD pays at each profiled point against plain vLLM at equal resources
    (module docstring): on CPU AFD 1A:1F with its ranks on `plain_devices` cores
    against plain vLLM's modelled step there, at the same batch; on CUDA 1A:1F on two
    GPUs against plain DP+EP on two GPUs, tok/s per GPU at the same batch per rank.

    Raises:
        ValueError: fewer than two distinct batch sizes in `points` or `plain`.
    """
    from afd_ray.plan.model import Layout, PerformanceModel

    cpu = profile.platform == "cpu"
    model = PerformanceModel(profile, host_cores=profile.plain_devices if cpu else None)
    out = []
    for point in profile.points:
        b, c = point.batch, point.context
        afd = model.tpot(Layout(1, 1, b), c)[0]
        plain = model.plain(b, c, gpus=2)
        # tok/s per core (CPU: both sides on the same cores) or per GPU (b / T over 2 GPUs vs b / T_plain per GPU)
        ratio = plain.tpot_ms / afd if cpu else plain.tpot_ms / (2 * afd)
        share = point.ffn_ms / point.step_ms
        num_bytes = 2 * profile.num_layers * b * profile.hidden_size * profile.bytes_per_elem
        side = f"plain vLLM on {profile.plain_devices:g} cores" if cpu else "plain vLLM DP+EP on 2 GPUs"
        winner = "AFD pays" if ratio > 1 else "plain vLLM wins"
        reason = (
            f"{winner}: AFD 1A:1F TPOT {afd:.2f} ms vs {side} {plain.tpot_ms:.2f} ms at batch {b}, "
            f"AFD/plain tok/s per {'core' if cpu else 'GPU'} {ratio:.2f}x (FFN {share:.0%} of the split step)"
        )
        out.append(
            Verdict(
                batch=b,
                ffn_share=share,
                bytes_per_step=num_bytes,
                transfer_ms=model.t_transfer(b),
                afd_tpot_ms=afd,
                plain_tpot_ms=plain.tpot_ms,
                afd_over_plain=ratio,
                can_pay=ratio > 1,
                reason=reason,
            )
        )
    return out


def load_profile(path: Path) -> Profile:
    """Read a profile written by `afd-ray profile` (CPU or `--platform cuda`).

    Raises:
        ValueError: not JSON, or not a profile; the message names the file and the bad
            field (e.g. `points.0.step_ms: Input should be greater than 0`).
        OSError: the file cannot be read.
    """
    try:
        return Profile.model_validate_json(path.read_text())
    except ValidationError as e:
        if any(err["type"] == "json_invalid" for err in e.errors()):
            raise ValueError(f"{path}: not JSON: {e.errors()[0]['msg']}") from e
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in e.errors())
        raise ValueError(f"{path}: {problems}") from e
