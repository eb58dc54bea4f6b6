"""The attention engine's arguments as vLLM resolves them (no Ray, no engine start):
the FFN peer in vLLM's own config, outside its compile-cache key, and
`attention.engine_args` passed through."""

from __future__ import annotations

import dataclasses

import pytest
from vllm.engine.arg_utils import AsyncEngineArgs

from afd_ray.attention.engine import engine_args
from afd_ray.attention.ffn_client import FFNPeerConfig
from afd_ray.config import AttentionPoolConfig, ModelConfig
from afd_ray.config.engine_args import OWNED, engine_arg_value_errors
from afd_ray.connector.header import FFNAddress
from afd_ray.control.membership import AttentionAssignment
from afd_ray.models.embedded import resolve_checkpoint


def _assignment(port: int, epoch: int) -> AttentionAssignment:
    return AttentionAssignment.to_ffn(FFNAddress("127.0.0.1", port, port + 1), 0, 0, epoch, "shm", 30.0)


@pytest.mark.timeout(300)
def test_the_ffn_peer_is_in_vllms_config_and_out_of_its_compile_cache_key() -> None:
    """Two starts with other ports and epochs build vLLM configs that carry their own
    peer in `additional_config` and hash the same (`VllmConfig.compute_hash`, the key
    of vLLM's torch.compile cache): a dict there would be hashed by its JSON and miss
    the cache at every start."""
    model = ModelConfig()
    checkpoint = resolve_checkpoint(model)
    configs = [
        engine_args(
            model, AttentionPoolConfig(), checkpoint, "gate_on_ffn", _assignment(port, epoch)
        ).create_engine_config()
        for port, epoch in ((20000, 0), (31000, 7))
    ]
    peers = [config.additional_config for config in configs]
    assert all(isinstance(peer, FFNPeerConfig) for peer in peers)
    assert [peer.assignment.store_port for peer in peers] == [20000, 31000]
    assert configs[0].compute_hash() == configs[1].compute_hash()


ENGINE = {"enable_prefix_caching": True, "max_num_batched_tokens": 512, "seed": 7}


@pytest.mark.timeout(300)
def test_attention_engine_args_reach_vllms_config() -> None:
    """`attention.engine_args` end in the engine's `VllmConfig`, where vLLM's defaults
    (the same config without them) differ."""
    model = ModelConfig()
    checkpoint = resolve_checkpoint(model)
    given, default = (
        engine_args(model, AttentionPoolConfig(engine_args=extra), checkpoint, "gate_on_ffn").create_engine_config()
        for extra in (ENGINE, {})
    )
    settings = [
        (
            config.cache_config.enable_prefix_caching,
            config.scheduler_config.max_num_batched_tokens,
            config.model_config.seed,
        )
        for config in (given, default)
    ]
    assert settings[0] == (True, 512, 7)
    assert settings[1][1:] != (512, 7)


def test_every_argument_afd_ray_sets_is_owned() -> None:
    """A key `engine_args` sets itself can't come from `attention.engine_args` (it
    would be given twice); `attention_backend` is the one it lets them override."""
    model = ModelConfig()
    args = engine_args(model, AttentionPoolConfig(), resolve_checkpoint(model), "gate_on_ffn")
    defaults = AsyncEngineArgs(model=args.model)
    changed = {
        field.name
        for field in dataclasses.fields(args)
        if field.name != "model" and getattr(args, field.name) != getattr(defaults, field.name)
    }
    assert {"hf_overrides", "worker_extension_cls", "max_num_seqs"} <= changed
    assert changed - {"attention_backend"} <= set(OWNED) | {"model"}
    chosen = engine_args(
        model,
        AttentionPoolConfig(engine_args={"attention_backend": "CPU_ATTN"}),
        resolve_checkpoint(model),
        "gate_on_ffn",
    )
    assert chosen.attention_backend == "CPU_ATTN"


@pytest.mark.timeout(300)
def test_values_the_config_refuses_for_their_bounds_vllm_refuses_at_engine_start() -> None:
    """`attention.engine_args` values out of the bounds of vLLM's config fields
    (`engine_arg_value_errors`) are the ones vLLM refuses when it builds the engine's
    config, which it does at engine start; the same values in bounds build."""
    model = ModelConfig()
    checkpoint = resolve_checkpoint(model)
    for name, bad, good in (("block_size", -5, 16), ("max_num_batched_tokens", 0, 512)):
        assert name in engine_arg_value_errors({name: bad}, "attention.engine_args")
        assert engine_arg_value_errors({name: good}, "attention.engine_args") == {}
        args = engine_args(model, AttentionPoolConfig(), checkpoint, "gate_on_ffn")
        with pytest.raises(ValueError, match=name):  # pydantic's ValidationError from vLLM's config class
            dataclasses.replace(args, **{name: bad}).create_engine_config()
        dataclasses.replace(args, **{name: good}).create_engine_config()
