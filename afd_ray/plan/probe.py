"""One profiling engine: plain vLLM (`vllm.LLM`, eager, in-process engine core) in a
process of its own, whose environment (`afd_ray.attention.engine.engine_env`: OpenMP
threads, wait policy, no core binding) is set before torch starts, as an attention
rank's or the benchmark's plain engine's is.

    python -m afd_ray.plan.probe SPEC.json OUT.json

`SPEC.json` holds `measure`'s arguments; `OUT.json` gets its list of points.
`afd_ray.plan.profile.run_probe` starts it.

Profiler: PyTorch module forward hooks. Each decoder layer's attention module
(`self_attn`) and FFN module (`mlp` / `block_sparse_moe`) get a pre- and a post-hook
timed with `time.perf_counter`; the model's own pre-hook marks the start of every
forward, so the time from one decode forward's start to the next is the whole engine
step (scheduling, forward, sampling). On CPU every op is synchronous, so the hooks time
the work. Wall time, not CPU time: the ranks of a layout and plain vLLM are measured
(and later served) on the same machine, and on a machine busy with other work the time
spent waiting for a core is part of what a client sees; a CPU-time split predicted
AFD's TPOT 26-42% low against a wall-time plain engine on a 2-core machine at load
13-21 (2026-12-07), while plain vLLM, timed in wall time, stayed within 11-12%.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["measure"]

_FFN_MODULES = ("mlp", "block_sparse_moe")


class _Hooks:
    """Forward hooks that time the attention and FFN modules of every forward."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.forwards: list[dict[str, float]] = []
        self._open: dict[str, float] = {}
        self._handles = []
        layers = 0
        for name, module in model.named_modules():
            parts = name.split(".")
            if len(parts) >= 3 and parts[-3] == "layers" and parts[-2].isdigit():
                role = "attention" if parts[-1] == "self_attn" else "ffn" if parts[-1] in _FFN_MODULES else None
                if role is None:
                    continue
                layers += role == "attention"
                self._handles.append(module.register_forward_pre_hook(self._start(role)))
                self._handles.append(module.register_forward_hook(self._stop(role)))
        if layers == 0:
            raise ValueError("model: no `layers.N.self_attn` modules found to profile")
        self._handles.append(model.register_forward_pre_hook(self._forward))

    def _forward(self, module: torch.nn.Module, args: tuple) -> None:
        self.forwards.append({"start": time.perf_counter(), "attention": 0.0, "ffn": 0.0, "tokens": 0})

    def _start(self, role: str):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            if role == "ffn" and self.forwards and not self.forwards[-1]["tokens"]:
                self.forwards[-1]["tokens"] = args[0].shape[0]
            self._open[role] = time.perf_counter()

        return hook

    def _stop(self, role: str):
        def hook(module: torch.nn.Module, args: tuple, output: object) -> None:
            self.forwards[-1][role] += time.perf_counter() - self._open.pop(role)

        return hook

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _decode_point(forwards: list[dict[str, float]], batch: int, context: float) -> dict[str, float]:
    """The medians over the decode forwards (exactly `batch` rows) that have a
    successor of the step, attention and FFN times, ms."""
    steps = [
        (nxt["start"] - cur["start"], cur["attention"], cur["ffn"])
        for cur, nxt in zip(forwards, forwards[1:])
        if cur["tokens"] == batch
    ]
    if len(steps) < 3:
        raise RuntimeError(f"batch {batch}: only {len(steps)} decode steps were timed")
    step, attention, ffn = (statistics.median(column) * 1e3 for column in zip(*steps, strict=True))
    return {"batch": batch, "context": context, "step_ms": step, "attention_ms": attention, "ffn_ms": ffn}


def measure(
    checkpoint: str, batches: Sequence[int], prompt_tokens: Sequence[int], decode_steps: int, dtype: str
) -> list[dict[str, float]]:
    """For every prompt length and batch size, generate `decode_steps` + 1 tokens for
    `batch` random prompts at once (greedy, EOS ignored) after one warm-up generation
    per batch size, and time the decode steps (`_decode_point`). Context of a point:
    the prompt length plus half the decode steps.

    Raises:
        ValueError: no decoder layers found.
        RuntimeError: too few decode steps could be timed.
    """
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=checkpoint,
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
    vocab = json.loads((Path(checkpoint) / "config.json").read_text())["vocab_size"]
    generator = torch.Generator().manual_seed(0)
    points = []
    try:
        for batch in batches:  # the first forward of each batch size builds kernels and buffers
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
        llm.llm_engine.engine_core.shutdown()
    return points


if __name__ == "__main__":
    spec, out = (Path(arg) for arg in sys.argv[1:3])
    Path(out).write_text(json.dumps(measure(**json.loads(spec.read_text()))))
