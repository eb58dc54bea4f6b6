"""The baseline: plain vLLM (no AFD) behind the same Serve application shape.

Why this baseline, and not `vllm serve` or an `LLM` in a subprocess: the AFD path is
HTTP → Serve proxy → `Ingress` replica → `AttentionServer` replica (an `AsyncLLM`
behind vLLM's OpenAI serving layer). A separate `vllm serve` would skip two Serve hops
and use its own HTTP server, so the comparison would mix the cost of AFD with the
cost of Ray Serve. Here the plain engine runs in a `PlainServer` replica behind the very
same `Ingress` class, with the same engine arguments (`engine_args` of the attention
pool, `attention.engine_args` included, minus the three things that make it an AFD
rank: the architecture override, the AFD worker extension and the AFD compilation
settings: `plain_engine_args`) and the same engine environment
(`engine_env`). The plain engine keeps vLLM's own compilation defaults: with
`enforce_eager: false` its default CUDA-graph mode (FULL_AND_PIECEWISE on CUDA),
against the AFD rank's piecewise graphs split at the FFN ops, so each side runs its
best graph setting. What is left is the one difference measured: the whole model in
one vLLM engine, against attention in vLLM plus the FFN pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

from ray import serve
from ray.serve import Application
from vllm.config import CompilationConfig
from vllm.engine.arg_utils import AsyncEngineArgs

from afd_ray.attention.engine import engine_args, engine_env
from afd_ray.attention.server import AttentionServer
from afd_ray.config import AFDConfig, AttentionPoolConfig, ModelConfig
from afd_ray.control.membership import AFDStatus, PoolLoad
from afd_ray.models.embedded import resolve_checkpoint
from afd_ray.platform import actor_resources, resource_key
from afd_ray.serve.access import AccessKeys
from afd_ray.serve.ingress import Ingress

__all__ = ["PlainServer", "build_plain_app", "plain_engine_args"]


class PlainServer(AttentionServer):
    """An `AttentionServer` whose engine runs the checkpoint's own vLLM model class.

    It answers the attention role's calls (`chat`, `completions`, `models`,
    `check_health`, inherited) and the coordinator's `status`, which shows no pools,
    and `pool_load` (one rank), so the unchanged `Ingress` can front it.
    """

    async def __init__(self, model: ModelConfig, attention: AttentionPoolConfig) -> None:
        """Start the plain engine and vLLM's OpenAI serving layer on it.

        Raises:
            ValueError: `model.source` cannot be resolved to a checkpoint folder.
        """
        self.rank = 0
        self._draining = asyncio.Event()
        self._drained = asyncio.Event()
        """Never set: the baseline engine is never drained or resized."""
        os.environ.update(engine_env(attention))
        checkpoint = resolve_checkpoint(model)
        self._start(plain_engine_args(model, attention, checkpoint), model.name, checkpoint, metrics=True)

    async def pool_load(self) -> PoolLoad | None:
        """The coordinator's `pool_load` of the baseline: one engine, admitted on queue
        room only (no KV or FFN figures; a benchmark never runs past its capacity)."""
        return PoolLoad(attention_ranks=1)

    async def status(self) -> AFDStatus:
        """`/afd/status` of a plain engine: no attention or FFN pool."""
        return AFDStatus(epoch=0, attention=[], ffn=[])

    async def __del__(self) -> None:
        """Stop the EngineCore; there is no FFN peer or coordinator to tell."""
        if hasattr(self, "_engine"):
            self._engine.shutdown()


def plain_engine_args(model: ModelConfig, attention: AttentionPoolConfig, checkpoint: Path) -> AsyncEngineArgs:
    """The attention rank's `engine_args` (its `attention.engine_args` and
    `model.quantization` included) less the three that make it an AFD rank: the
    architecture override, the worker extension and the AFD compilation settings
    (vLLM's own compilation and CUDA-graph defaults instead)."""
    return dataclasses.replace(
        engine_args(model, attention, checkpoint, "gate_on_ffn"),
        hf_overrides={},
        worker_extension_cls="",
        compilation_config=CompilationConfig(),
    )


CONTROL_CALLS = 4
"""Concurrent calls the plain replica takes beyond `attention.max_num_seqs`
completions: the ingress's load reads, `/afd/status` and health calls."""


def build_plain_app(cfg: AFDConfig) -> Application:
    """The plain-vLLM counterpart of `afd_ray.serve.app.build_app(cfg)`: one
    `PlainServer` replica with the attention pool's deployment options, behind the same
    `Ingress` with the same options. `cfg.attention.num_ranks` and `cfg.ffn` are
    ignored: the baseline is one engine.
    """
    key = resource_key(cfg.platform)
    bundle = cfg.attention.bundle_resources
    plain = (
        serve.deployment(PlainServer)
        .options(
            name="plain",
            num_replicas=1,
            # The replica is also the ingress's coordinator: its load reads and status
            # calls must not queue behind a full batch of completions (the ingress
            # then finds the coordinator silent and answers 503).
            max_ongoing_requests=cfg.attention.max_num_seqs + CONTROL_CALLS,
            ray_actor_options=dict(actor_resources(cfg.platform, bundle)),
            placement_group_bundles=[{key: bundle}],
            placement_group_strategy="STRICT_PACK",
        )
        .bind(cfg.model, cfg.attention)
    )
    ingress = serve.deployment(Ingress).options(
        name="ingress",
        max_ongoing_requests=cfg.ingress.max_ongoing_requests,
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(
        plain, plain, plain, cfg.attention, cfg.ffn, cfg.ingress, cfg.autoscale, AccessKeys.from_env(cfg.ingress)
    )
