"""vLLM worker extension: the worker process's FFN client, and AFD inspection.

The worker owns its `FFNClient`: it opens it on the FFN peer of its engine's
`FFNPeerConfig` (vLLM's `additional_config`) when vLLM builds the AFD model
(`afd_ray.attention.ffn_op.attach_ffn_peer`, the hook the model's layers call at build:
vLLM mixes the extension class into its worker class, so it has no constructor of its
own, and the model is built, then profiled and warmed up, before any `collective_rpc`
can reach it), moves it to a new peer (`afd_repeer`) and closes it (`afd_close`).

vLLM's EngineCore runs `collective_rpc` calls between two engine steps, so no
forward pass (and no A2F/F2A exchange) is in flight while the pair channel changes.
"""

from __future__ import annotations

from dataclasses import asdict


from afd_ray.attention.ffn_client import FFNClient, record_steps, take_steps
from afd_ray.attention.ffn_op import bound_ffn_client, close_ffn_client, ffn_client, use_ffn_client
from afd_ray.compat import batch_request_ids
from afd_ray.control.membership import AttentionAssignment
from afd_ray.weights import resident_bytes

__all__ = ["AFDWorkerExtension"]


class AFDWorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`); called via `collective_rpc`."""

    def afd_param_bytes(self) -> dict[str, int]:
        """Resident parameter bytes of the attention-role model, by leaf module kind.

        Keys are the parameter name with layer indices removed (e.g.
        `model.layers.self_attn.qkv_proj.weight`); values are bytes.
        """
        return resident_bytes(self.model_runner.model)

    def afd_graphs_captured(self) -> int:
        """CUDA graphs vLLM captured in this worker (its `compilation_counter`; with
        piecewise graphs, one per piece and batch size; 0 when eager)."""
        from vllm.compilation.counter import compilation_counter

        return compilation_counter.num_cudagraph_captured

    def afd_graph_replays(self) -> int:
        """Forward passes this worker ran as whole-step CUDA-graph replays
        (`FFNClient.replays`; 0 unless `attention.cudagraph_mode: full_decode`)."""
        return ffn_client().replays

    def afd_connect(self, step_records: int) -> None:
        """Check that the pair channel to the FFN peer is open (JOINed when vLLM built
        the model; vLLM's CPU engine runs no forward pass at start-up); keep the last
        `step_records` steps' timing records, each naming the model runner's batch.

        Raises:
            RuntimeError: no client is bound (the engine was built without an `FFNPeerConfig`).
        """
        runner = self.model_runner
        record_steps(step_records, lambda: batch_request_ids(runner))
        ffn_client()

    def afd_take_steps(self) -> list[dict[str, object]]:
        """The attention steps recorded since the previous call, oldest first, each an
        `afd_ray.observability.steps.AttentionStep` as a dict (vLLM's RPC carries
        plain data)."""
        return [asdict(step) for step in take_steps()]

    def afd_repeer(self, assignment_json: str) -> None:
        """Move the pair channel to the FFN peer of `assignment_json` (an
        `AttentionAssignment` as JSON): LEAVE the old peer, then JOIN the new one
        (blocks until the new FFN peer admits it at its next step boundary).

        Raises:
            RuntimeError / DistStoreError: the new peer did not admit it within the timeout.
        """
        assignment = AttentionAssignment.model_validate_json(assignment_json)
        held = bound_ffn_client()
        if held is not None and held.assignment.epoch >= assignment.epoch:
            return  # already there: it moved inside a forward pass when its old peer died
        close_ffn_client()
        use_ffn_client(FFNClient(assignment))

    def afd_close(self) -> None:
        """Close the pair channel (LEAVE): this rank is leaving the pool."""
        close_ffn_client()
