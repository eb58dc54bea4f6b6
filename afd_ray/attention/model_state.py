"""The STEP header of a forward pass that vLLM replays as one CUDA graph.

With `attention.cudagraph_mode: full_decode` vLLM captures whole decode steps, FFN
exchanges included, and replays them with `run_fullgraph`: none of the model's
Python runs, so `begin_ffn_step` in the model's `forward` cannot announce them. The
host hook that runs instead is the model's own `ModelState`, a vLLM extension point of
its model runner V2: a model class that defines `get_model_state_cls()` supplies it
(`vllm.v1.worker.gpu.model_states.init_model_state`, 0.26 and 0.32). The runner
calls `prepare_attn(input_batch, cudagraph_mode, ...)` once per `execute_model`, after
it picked the batch's graph; with `cudagraph_mode` FULL it replays that graph right
after (`vllm.v1.worker.gpu.model_runner.GPUModelRunner.execute_model`, 0.26 and 0.32),
for `input_batch.num_tokens_after_padding` rows: the graph's size, which is what the
captured exchanges send. Graph capture calls `prepare_attn` with NONE
(`cudagraph_utils.prepare_inputs_to_capture`) and announces nothing; the capture's
own forward pass skips its header too (`afd_ray.attention.ffn_op.begin_ffn_step`).
vLLM 0.32's own micro-batching (`vllm.v1.worker.gpu.ubatch_utils`) would call
`prepare_attn` once per ubatch; AFD engines do not turn it on.

vLLM 0.26 runs MoE architectures outside its own list on its V1 runner, which has no
such hook; `afd_ray.attention.engine.engine_env` therefore selects the V2 runner in
`full_decode` mode.
"""

from __future__ import annotations

from typing import Any

from vllm.config import CUDAGraphMode
from vllm.v1.worker.gpu.model_states.default import DefaultModelState

from afd_ray.attention.ffn_op import announce_replay

__all__ = ["AFDModelState"]


class AFDModelState(DefaultModelState):
    """vLLM's default model state, plus the STEP header of every whole-step graph replay."""

    def prepare_attn(self, input_batch: Any, cudagraph_mode: CUDAGraphMode, *args: Any, **kwargs: Any) -> Any:
        """vLLM's attention metadata for `input_batch`; when the runner replays a FULL
        graph next, first the STEP header of its `num_tokens_after_padding` rows.

        Raises:
            PeerLostError: the header socket is closed (the engine step fails).
        """
        metadata = super().prepare_attn(input_batch, cudagraph_mode, *args, **kwargs)
        if cudagraph_mode == CUDAGraphMode.FULL:
            announce_replay(input_batch.num_tokens_after_padding)
        return metadata
