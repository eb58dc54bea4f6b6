"""The vLLM engine of one attention rank: its engine args and its process environment.

Everything vLLM-specific that the config tree decides lives here. What makes the
engine an AFD attention rank is three arguments: `hf_overrides` swaps the checkpoint's
architecture for its AFD class (attention role only, MLPs behind `remote_ffn`),
`worker_extension_cls` gives vLLM's worker its FFN client and AFD inspection, and
`additional_config` (an `FFNPeerConfig`) names the FFN peer that client opens first.
"""

from __future__ import annotations

from pathlib import Path

from vllm.config import CompilationConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.platforms import current_platform

from afd_ray.attention.ffn_client import FFNPeerConfig
from afd_ray.attention.ffn_op import SPLITTING_OPS
from afd_ray.attention.plugin import afd_architecture
from afd_ray.compat import attention_backend, splitting_ops_with
from afd_ray.attention.worker import AFDWorkerExtension
from afd_ray.attention.models.base import GATE_ON_ATTENTION
from afd_ray.config import AttentionPoolConfig, GatePlacement, ModelConfig
from afd_ray.control.membership import AttentionAssignment

__all__ = ["afd_compilation_config", "engine_args", "engine_env"]

GIB = 1 << 30


def engine_args(
    model: ModelConfig,
    attention: AttentionPoolConfig,
    checkpoint: Path,
    gate_placement: GatePlacement,
    assignment: AttentionAssignment | None = None,
) -> AsyncEngineArgs:
    """The `AsyncLLM` arguments of one attention rank.

    Args:
        model: which model, its dtype, quantization and context length (`max_model_len` tokens).
        attention: batch size, KV-cache budget (GiB), tokens per streamed chunk, eager
            and CUDA-graph mode of the rank, and further vLLM engine arguments
            (`engine_args`).
        gate_placement: where MoE routing runs; reaches the AFD model class as the
            config attribute `afd_gate_on_attention`.
        checkpoint: a local Hugging Face folder (config.json, safetensors,
            tokenizer), as returned by `afd_ray.models.embedded.resolve_checkpoint`.
        assignment: the FFN peer the worker pairs with when vLLM builds the model
            (`FFNPeerConfig`, vLLM's `additional_config`, kept out of its compile-cache
            key). None: no FFN peer (the plain baseline, or arguments only inspected).

    Raises:
        ValueError: the checkpoint's architecture has no AFD class (names `model.source`).

    Compilation: `afd_compilation_config` (eager, or vLLM's CUDA graphs split at the
    FFN boundary ops, with whole decode steps captured in `full_decode` mode).

    The KV-cache budget goes through `kv_cache_memory_bytes`, which every vLLM
    platform honours; on CPU it is what `VLLM_CPU_KVCACHE_SPACE` would set, without
    that variable's whole-GiB granularity.

    The attention backend is chosen explicitly where vLLM would pick it by CPU flag
    and get the dtype wrong (`afd_ray.compat.attention_backend`: MLA on AMX CPUs),
    unless `attention.engine_args` names one.

    `model.quantization` becomes vLLM's `quantization`; `attention.engine_args` are
    passed on as they are (validated against vLLM's `EngineArgs` fields, none of those
    set here: `afd_ray.config.engine_args.OWNED`).
    """
    chosen = {"attention_backend": attention_backend(checkpoint, model.dtype)} | attention.engine_args
    return AsyncEngineArgs(
        model=str(checkpoint),
        served_model_name=[model.name],
        dtype=model.dtype,
        max_model_len=model.max_model_len,
        max_num_seqs=attention.max_num_seqs,
        stream_interval=attention.stream_interval,
        enforce_eager=attention.enforce_eager,
        load_format=model.load_format,
        quantization=model.quantization,
        kv_cache_memory_bytes=int(attention.kv_cache_gib * GIB),
        gpu_memory_utilization=attention.gpu_memory_utilization,
        hf_overrides={
            "architectures": [afd_architecture(checkpoint)],
            GATE_ON_ATTENTION: gate_placement == "gate_on_attention",
        },
        worker_extension_cls=f"{AFDWorkerExtension.__module__}.{AFDWorkerExtension.__qualname__}",
        compilation_config=afd_compilation_config(attention),
        additional_config={} if assignment is None else FFNPeerConfig(assignment=assignment),
        **chosen,
    )


def afd_compilation_config(attention: AttentionPoolConfig) -> CompilationConfig:
    """The compilation settings of an AFD attention rank.

    `attention.enforce_eager`: vLLM's defaults (`enforce_eager` turns them off).
    Otherwise vLLM's torch.compile with CUDA graphs whose splitting ops are vLLM's own
    (attention) plus the AFD boundary ops (`afd_ray.attention.ffn_op.SPLITTING_OPS`),
    in the mode `attention.cudagraph_mode` names:

    - `piecewise` (vLLM `PIECEWISE`): each layer's A2F/F2A exchange and each forward
      pass's STEP header run eagerly between captured pieces.
    - `full_decode` (vLLM `FULL_AND_PIECEWISE`): uniform decode batches replay one
      graph of the whole forward pass, the exchanges captured in it as device work
      (`cuda_ipc` copies and signal put/wait); the STEP header of each replay is sent
      on the host by the model's vLLM `ModelState` (`afd_ray.attention.model_state`),
      for the graph's padded size. Prefill and mixed batches run piecewise, as above.
      Failure: a dead FFN peer is found by the device-side wait of the replay, which
      traps after `connector.timeout_s` and ends the engine's CUDA context; the engine
      fails and Serve replaces the replica. The in-pass resume on a new FFN peer
      (`afd_ray.attention.ffn_client`) is not available inside a replay.

    On CPU vLLM compiles without graphs and ignores both settings.
    """
    if attention.enforce_eager:
        return CompilationConfig()
    mode = "FULL_AND_PIECEWISE" if attention.cudagraph_mode == "full_decode" else "PIECEWISE"
    return CompilationConfig(cudagraph_mode=mode, splitting_ops=splitting_ops_with(SPLITTING_OPS))


def engine_env(attention: AttentionPoolConfig) -> dict[str, str]:
    """Environment variables to set in an attention replica before it starts vLLM.

    vLLM's EngineCore and worker processes are spawned from the replica and inherit
    its environment, so this is where their threading is decided:

    - `OMP_NUM_THREADS`: `attention.num_threads` OpenMP/torch threads per worker.
    - `VLLM_CPU_OMP_THREADS_BIND=nobind`: vLLM CPU otherwise pins every engine on a
      host to the same cores and overrides `OMP_NUM_THREADS`; several ranks on one
      small machine would pile onto core 0. Placement decides cores, not vLLM.
    - `OMP_WAIT_POLICY=PASSIVE`, `KMP_BLOCKTIME=0`: idle OpenMP threads sleep
      instead of spinning, which otherwise starves co-located processes (the FFN
      rank) on few cores (measured: 16 → 47 tok/s on 2 cores).

    - `VLLM_ENABLE_V1_MULTIPROCESSING=0`: the model runs in the EngineCore process
      (vLLM's `uni` executor), as it does on CUDA with one GPU. `AsyncLLM` still runs
      its EngineCore in a process of its own; the variable only stops vLLM's CPU
      platform from forcing the `mp` executor, whose extra worker process exists to
      bind OpenMP threads (`nobind` above turns that off). One process less per rank:
      it imported vLLM again (13-15 s of a rank's start on 2 cores) and relayed every
      step through a message queue.

    - `VLLM_USE_V2_MODEL_RUNNER=1`, on CUDA with graphs in `full_decode` mode only:
      the host hook that announces whole-step graph replays is a `ModelState`, which
      only vLLM's model runner V2 has; vLLM 0.26 picks its V1 runner for MoE
      architectures outside its own list (`VllmConfig._is_default_v2_model_runner_model`),
      the AFD MoE classes included. (On CPU vLLM captures no graphs, and its V2
      runner needs Triton.)

    - `SPT_NOENV=1`: vLLM titles the EngineCore process (`VLLM::EngineCore`) with
      `setproctitle`, which by default makes room for the title by zeroing the
      process's exec-time environment strings (those after argv, up to the first
      one the process changed before the title was set). The process's own
      `os.environ` is unaffected, but `/proc/<pid>/environ` (`ps e`, psutil) then
      shows none or part of this env, depending on the variables' order. With
      `SPT_NOENV` setproctitle writes the title within argv only (the spawn command
      line is far longer than the title).

    `VLLM_CPU_*` variables are read only by the CPU backend.
    """
    full = attention.cudagraph_mode == "full_decode" and not attention.enforce_eager and current_platform.is_cuda()
    return ({"VLLM_USE_V2_MODEL_RUNNER": "1"} if full else {}) | {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "OMP_NUM_THREADS": str(attention.num_threads),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_WAIT_POLICY": "PASSIVE",
        "KMP_BLOCKTIME": "0",
        "SPT_NOENV": "1",
    }
