"""The benchmark's plain-vLLM application, without a cluster."""

from __future__ import annotations

from afd_ray.bench.plain import CONTROL_CALLS, build_plain_app
from afd_ray.config import AFDConfig


def test_the_plain_replica_takes_control_calls_beside_a_full_batch() -> None:
    """The plain replica is also the ingress's coordinator. With room for exactly
    `max_num_seqs` calls, a full batch of completions queued the ingress's load reads
    for longer than the ingress waits for a silent coordinator, and `/afd/status`
    answered 503 after a bench run of 8 streams (2-core machine, 2026-12-02)."""
    cfg = AFDConfig.model_validate({"attention": {"max_num_seqs": 8}})
    plain = build_plain_app(cfg)._bound_deployment.init_args[0]._bound_deployment
    assert plain.name == "plain"
    assert plain.max_ongoing_requests == 8 + CONTROL_CALLS > cfg.attention.max_num_seqs
