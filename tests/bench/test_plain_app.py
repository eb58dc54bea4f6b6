"""The benchmark's plain-vLLM application, without a cluster."""

from __future__ import annotations

import dataclasses

from vllm.config import CompilationConfig

from afd_ray.attention.engine import engine_args
from afd_ray.bench.plain import CONTROL_CALLS, build_plain_app, plain_engine_args
from afd_ray.config import AFDConfig
from afd_ray.models.embedded import resolve_checkpoint


def test_the_plain_replica_takes_control_calls_beside_a_full_batch() -> None:
    """The plain replica is also the ingress's coordinator. With room for exactly
    `max_num_seqs` calls, a full batch of completions queued the ingress's load reads
    for longer than the ingress waits for a silent coordinator, and `/afd/status`
    answered 503 after a bench run of 8 streams (2-core machine, 2026-12-02)."""
    cfg = AFDConfig.model_validate({"attention": {"max_num_seqs": 8}})
    plain = build_plain_app(cfg)._bound_deployment.init_args[0]._bound_deployment
    assert plain.name == "plain"
    assert plain.max_ongoing_requests == 8 + CONTROL_CALLS > cfg.attention.max_num_seqs


def test_the_plain_engine_gets_the_attention_engine_args() -> None:
    """The baseline runs with the same `attention.engine_args` as the AFD ranks, and
    without the three arguments that make an engine an AFD rank."""
    cfg = AFDConfig.model_validate(
        {"attention": {"engine_args": {"enable_prefix_caching": True, "max_num_batched_tokens": 512, "seed": 7}}}
    )
    checkpoint = resolve_checkpoint(cfg.model)
    plain = plain_engine_args(cfg.model, cfg.attention, checkpoint)
    afd = engine_args(cfg.model, cfg.attention, checkpoint, "gate_on_ffn")
    assert (plain.enable_prefix_caching, plain.max_num_batched_tokens, plain.seed) == (True, 512, 7)
    assert (plain.hf_overrides, plain.worker_extension_cls) == ({}, "")
    assert plain.compilation_config == CompilationConfig()
    same = [
        f.name
        for f in dataclasses.fields(plain)
        if f.name not in ("hf_overrides", "worker_extension_cls", "compilation_config")
    ]
    assert [getattr(plain, name) for name in same] == [getattr(afd, name) for name in same]
