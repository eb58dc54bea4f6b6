"""`afd-ray profile`: split a colocated decode step into attention, FFN/MoE and
communication time per batch size, and say whether AFD can pay.

Profiler: PyTorch module forward hooks timed with `time.process_time` (CPU time of
this process, all its threads), on the model that plain vLLM (`vllm.LLM`, in this
process, eager mode, no AFD) runs. CPU time, not wall time: on a machine shared with
other work, time spent waiting for a core is not the model's cost (the planner's
`host_cores` term models the sharing). With more than one engine thread the CPU time
of a step is the sum over its threads. Each decoder
layer's attention module (`self_attn`) and FFN module (`mlp` / `block_sparse_moe`) get
a pre- and a post-hook; the model's own pre-hook marks the start of every forward, so
the time from one decode forward's start to the next is the whole engine step
(scheduling, forward, sampling). On CPU every op is synchronous, so the hooks time the
work itself. (On a GPU they would time kernel launches only: there, use a GPU decode
benchmark JSON, which `load_profile` accepts: `benchmarks/results/h200x2-2026-11-29.json`,
measured with the former stand-alone GPU harness, fixes its format.)

Communication inside a colocated step is zero on one device. What AFD would add is
measured separately (`afd_ray.plan.link`): the connector's layer round trip on this
machine, fitted to a latency and a bandwidth.

Verdict per batch size b (`verdicts`): AFD can pay when the FFN is a large enough part
of the step to be worth its own devices, `ffn_share >= MIN_FFN_SHARE`, and the A2F/F2A
traffic docs/models.md gives, `2 × L × b × H × bytes_per_elem` bytes in `2 × L`
messages, costs less on the link than the FFN time it takes off the attention ranks
(`transfer_ms < ffn_ms`); with DBO that traffic can then hide behind compute.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from pydantic import ValidationError

from afd_ray.plan.schema import Link, Profile, StepPoint, Verdict

__all__ = ["MIN_FFN_SHARE", "load_profile", "profile_vllm", "verdicts"]

MIN_FFN_SHARE = 0.3
"""Below this FFN share of the step, a separate FFN pool has too little to batch."""

_FFN_MODULES = ("mlp", "block_sparse_moe")


class _Hooks:
    """Forward hooks that time the attention and FFN modules of every forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.forwards: list[dict[str, float]] = []
        self._open: dict[str, float] = {}
        self._handles = []
        self.layers = 0
        for name, module in model.named_modules():
            parts = name.split(".")
            if len(parts) >= 3 and parts[-3] == "layers" and parts[-2].isdigit():
                role = "attention" if parts[-1] == "self_attn" else "ffn" if parts[-1] in _FFN_MODULES else None
                if role is None:
                    continue
                self.layers += role == "attention"
                self._handles.append(module.register_forward_pre_hook(self._start(role)))
                self._handles.append(module.register_forward_hook(self._stop(role)))
        if self.layers == 0:
            raise ValueError("model: no `layers.N.self_attn` modules found to profile")
        self._handles.append(model.register_forward_pre_hook(self._forward))

    def _forward(self, module: torch.nn.Module, args: tuple) -> None:
        self.forwards.append({"start": time.process_time(), "attention": 0.0, "ffn": 0.0, "tokens": 0})

    def _start(self, role: str):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            if role == "ffn" and self.forwards and not self.forwards[-1]["tokens"]:
                self.forwards[-1]["tokens"] = args[0].shape[0]
            self._open[role] = time.process_time()

        return hook

    def _stop(self, role: str):
        def hook(module: torch.nn.Module, args: tuple, output: object) -> None:
            self.forwards[-1][role] += time.process_time() - self._open.pop(role)

        return hook

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _decode_point(forwards: list[dict[str, float]], batch: int, context: float) -> StepPoint:
    """Lower quartile over the decode forwards (exactly `batch` rows) that have a
    successor: other work on the machine only ever adds time, so the lower quartile is
    closer to the step's own cost than the median."""
    steps = [
        (nxt["start"] - cur["start"], cur["attention"], cur["ffn"])
        for cur, nxt in zip(forwards, forwards[1:])
        if cur["tokens"] == batch
    ]
    if len(steps) < 3:
        raise RuntimeError(f"batch {batch}: only {len(steps)} decode steps were timed")
    step, attention, ffn = (
        statistics.quantiles(column, n=4, method="inclusive")[0] * 1e3 for column in zip(*steps, strict=True)
    )
    return StepPoint(batch=batch, context=context, step_ms=step, attention_ms=attention, ffn_ms=ffn)


def profile_vllm(
    checkpoint: Path,
    batches: Sequence[int],
    prompt_tokens: Sequence[int],
    decode_steps: int = 16,
    threads: int = 1,
    dtype: str = "float32",
    link: Link | None = None,
) -> Profile:
    """Serve `checkpoint` with plain vLLM in this process and time decode steps.

    For every prompt length in `prompt_tokens` and batch size in `batches`, generate
    `decode_steps` + 1 tokens for `batch` random prompts at once (greedy, EOS ignored)
    and keep the median of the decode steps. The engine runs with `threads` OpenMP
    threads, as one attention rank does (`afd_ray.attention.engine.engine_env`).

    Args:
        link: the A2F/F2A link; None measures the connector over gloo here.

    Raises:
        ValueError: no decoder layers found; an empty `batches` or `prompt_tokens`, a
            batch above `afd_ray.plan.plan.MAX_BATCH`.
        RuntimeError: too few decode steps could be timed.
    """
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from afd_ray.attention.engine import engine_env
    from afd_ray.config import AttentionPoolConfig
    from afd_ray.plan.link import measure_link
    from afd_ray.plan.plan import MAX_BATCH

    if not batches or not prompt_tokens:
        raise ValueError("batches, prompt_tokens: at least one value each")
    if max(batches) > MAX_BATCH:
        raise ValueError(f"batches: each at most {MAX_BATCH} (MAX_BATCH), got {max(batches)}")
    config = json.loads((checkpoint / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    torch_dtype = getattr(torch, dtype)
    link = link or measure_link(hidden, torch_dtype)

    os.environ.update(engine_env(AttentionPoolConfig(num_threads=threads)))
    # In-process engine core: the hooks run in this process and their timings stay here.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    llm = LLM(
        model=str(checkpoint),
        dtype=dtype,
        enforce_eager=True,
        max_model_len=max(prompt_tokens) + decode_steps + 8,
        max_num_seqs=max(batches),
        enable_prefix_caching=False,
        kv_cache_memory_bytes=1 << 28,
        seed=0,
    )
    (model,) = llm.apply_model(lambda m: m)
    hooks = _Hooks(model)
    vocab = config["vocab_size"]
    generator = torch.Generator().manual_seed(0)
    points = []
    try:
        # Warm-up: the first forward of each batch size builds kernels and buffers.
        for batch in batches:
            warm = [TokensPrompt(prompt_token_ids=[2] * min(prompt_tokens)) for _ in range(batch)]
            llm.generate(warm, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
        for length in prompt_tokens:
            for batch in batches:
                prompts = [
                    TokensPrompt(prompt_token_ids=torch.randint(2, vocab, (length,), generator=generator).tolist())
                    for _ in range(batch)
                ]
                hooks.forwards.clear()
                params = SamplingParams(max_tokens=decode_steps + 1, temperature=0, ignore_eos=True)
                llm.generate(prompts, params, use_tqdm=False)
                points.append(_decode_point(hooks.forwards, batch, length + decode_steps / 2))
    finally:
        hooks.close()
    moe = any(key in config for key in ("num_experts", "num_local_experts", "n_routed_experts"))
    profile = Profile(
        model=str(checkpoint),
        device=f"{_cpu_model()} ({threads} thread{'s' * (threads > 1)})",
        source="afd-ray profile: vLLM (in-process, eager) + torch forward hooks (time.process_time)",
        num_layers=layers,
        hidden_size=hidden,
        bytes_per_elem=torch_dtype.itemsize,
        moe=moe,
        points=points,
        link=link,
    )
    return profile.model_copy(update={"verdicts": verdicts(profile)})


def _cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "cpu"


def verdicts(profile: Profile) -> list[Verdict]:
    """Whether AFD can pay at each profiled batch size (module docstring)."""
    out = []
    for point in profile.points:
        share = point.ffn_ms / point.step_ms
        num_bytes = 2 * profile.num_layers * point.batch * profile.hidden_size * profile.bytes_per_elem
        messages = 2 * profile.num_layers
        transfer = messages * profile.link.latency_us / 1e3 + num_bytes / (profile.link.bandwidth_gbps * 1e9) * 1e3
        if share < MIN_FFN_SHARE:
            can_pay, reason = False, f"FFN is {share:.0%} of the step (< {MIN_FFN_SHARE:.0%}): little to offload"
        elif transfer >= point.ffn_ms:
            can_pay, reason = (
                False,
                (
                    f"A2F+F2A {transfer:.2f} ms/step ({messages} messages, {num_bytes:,.0f} B) "
                    f">= the FFN time it offloads ({point.ffn_ms:.2f} ms)"
                ),
            )
        else:
            can_pay, reason = (
                True,
                (f"FFN is {share:.0%} of the step and A2F+F2A costs {transfer:.2f} ms < {point.ffn_ms:.2f} ms of FFN"),
            )
        out.append(
            Verdict(
                batch=point.batch,
                ffn_share=share,
                bytes_per_step=num_bytes,
                transfer_ms=transfer,
                can_pay=can_pay,
                reason=reason,
            )
        )
    return out


def _from_gpu_bench(data: dict, model: str | None, source: str) -> Profile:
    """A `Profile` from a GPU decode benchmark JSON (the format of
    `benchmarks/results/h200x2-2026-11-29.json`, written by the stand-alone GPU harness
    that issue 12 removed): per batch, the attention-only step (`attention_ub1.step_ms`),
    the FFN-only step (`ffn_ub1.step_ms`) and the colocated step
    (`colocated_1gpu.step_ms`, whose rest is `other`); the link from the CUDA-graph
    layer round trips (`roundtrip_us_graph`) for the latency and the bulk A2F bandwidth
    (`p2p.a2f_bulk_GBps`).

    Raises:
        ValueError: `model` is not in the file (names the models it has).
    """
    models = data["models"]
    name = model or next(iter(models))
    if name not in models:
        raise ValueError(f"model: {name!r} is not in {source}; it has {sorted(models)}")
    entry = models[name]
    points = []
    for batch, figures in sorted(entry["batches"].items(), key=lambda item: int(item[0])):
        attention, ffn = figures["attention_ub1"]["step_ms"], figures["ffn_ub1"]["step_ms"]
        step = max(figures["colocated_1gpu"]["step_ms"], attention + ffn)
        points.append(
            StepPoint(batch=int(batch), context=entry["context"], step_ms=step, attention_ms=attention, ffn_ms=ffn)
        )
    round_trips = {int(t): us for t, us in data["roundtrip_us_graph"].items()}
    smallest = min(round_trips)
    link = Link(
        latency_us=round_trips[smallest] / 2,
        bandwidth_gbps=data["p2p"]["a2f_bulk_GBps"],
        source=f"{source}: roundtrip_us_graph[{smallest}] / 2, p2p.a2f_bulk_GBps",
    )
    profile = Profile(
        model=name,
        device=f"{data['gpu']} (x{data['gpus']})",
        source=f"GPU decode benchmark JSON {source}",
        num_layers=entry["num_layers"],
        hidden_size=entry["hidden_size"],
        bytes_per_elem=2 if "16" in data["dtype"] else 4,
        moe=True,
        points=points,
        link=link,
    )
    return profile.model_copy(update={"verdicts": verdicts(profile)})


def load_profile(path: Path, model: str | None = None) -> Profile:
    """Read a profile: `afd-ray profile`'s JSON, or the GPU benchmark's
    (e.g. `benchmarks/results/h200x2-2026-11-29.json`; `model` picks one of its
    models, default the first).

    Raises:
        ValueError: not JSON, or neither kind of file; the message names the file and
            the bad field (e.g. `points.0.step_ms: Input should be greater than 0`).
        OSError: the file cannot be read.
    """
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON: {e}") from e
    try:
        if isinstance(data, dict) and "models" in data and "roundtrip_us_graph" in data:
            return _from_gpu_bench(data, model, str(path))
        return Profile.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}" for err in e.errors())
        raise ValueError(f"{path}: {problems}") from e
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: GPU benchmark JSON without the field {e}") from e
