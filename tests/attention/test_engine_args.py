"""The FFN peer reaches the attention engine in vLLM's own config, outside its
compile-cache key (no Ray, no engine start)."""

from __future__ import annotations

import pytest

from afd_ray.attention.engine import engine_args
from afd_ray.attention.ffn_client import FFNPeerConfig
from afd_ray.config import AttentionPoolConfig, ModelConfig
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
