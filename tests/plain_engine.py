"""Plain vLLM (no AFD) as the reference engine of token-equality tests, run in the
test process."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from vllm import LLM
from vllm.distributed import cleanup_dist_env_and_memory


@contextmanager
def plain_llm(checkpoint: str, max_model_len: int, kv_cache_memory_bytes: int, **engine_args: object) -> Iterator[LLM]:
    """An in-process `vllm.LLM` on `checkpoint`, float32, eager, with further vLLM
    `engine_args` (an app's `attention.engine_args`), shut down on exit.

    `VLLM_ENABLE_V1_MULTIPROCESSING=0`: the model runs in this process, with no
    EngineCore child re-importing vLLM beside the session's application (about 20 s of
    a 2-core machine). On exit the engine core is shut down, vLLM's distributed state
    cleaned (the next engine in this process must not share it) and torch's thread
    count restored (the vLLM CPU worker lowers it in-process)."""
    threads = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        llm = LLM(
            checkpoint,
            dtype="float32",
            enforce_eager=True,
            max_model_len=max_model_len,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            **engine_args,
        )
        try:
            yield llm
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
            cleanup_dist_env_and_memory()
            torch.set_num_threads(threads)
