"""Dead FFN ranks found by the coordinator's recovery (`afd_ray.control.recovery`),
without Ray: the real registry and recovery, on a clock the test advances."""

from __future__ import annotations

from afd_ray.config import AFDConfig
from afd_ray.connector.channel import FFNAddress
from afd_ray.control.membership import LoopState
from afd_ray.control.recovery import Recovery
from afd_ray.control.registry import Registry
from afd_ray.control.resize import Resizer

LOADING_SILENCE_S = 14.0
"""How long the SmolLM2 FFN rank of deployments/afd.yaml went without a report while
it loaded, on the 2-core machine at load average 11 (it was declared dead 14 s after
it registered, 10.6 s after its last report, under the old 10 s default)."""


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _recovery(cfg: AFDConfig, clock: _Clock) -> tuple[Registry, Recovery]:
    """A registry with one registered FFN rank (rank 0, the first layout) and the
    recovery the coordinator builds from `cfg`."""
    registry = Registry("gloo", cfg.connector.timeout_s, cfg.ffn.num_ranks)
    registry.add_ffn(FFNAddress("127.0.0.1", 1, 2), replica="ffn#0")
    resizer = Resizer(registry, "afd", cfg.attention, cfg.ffn, cfg.autoscale)
    recovery = Recovery(registry, resizer, "afd", cfg.ffn.heartbeat_timeout_s, cfg.autoscale.resize_timeout_s,
                        clock=clock)  # fmt: skip
    return registry, recovery


def test_a_loading_ffn_rank_is_not_declared_dead_under_the_defaults() -> None:
    """With the default `ffn.heartbeat_timeout_s`, a rank silent as long as a loading
    rank was on the loaded CI machine is alive; silent past the timeout it is dead.
    Fails with the old 10 s default."""
    clock = _Clock()
    cfg = AFDConfig()
    _, recovery = _recovery(cfg, clock)
    states = {"ffn#0": "RUNNING"}
    recovery.heard(0, LoopState.SERVING)

    clock.now += LOADING_SILENCE_S
    assert recovery.dead(states) == {}

    recovery.heard(0, LoopState.SERVING)
    clock.now += cfg.ffn.heartbeat_timeout_s + 0.1
    (cause,) = recovery.dead(states).values()
    assert "ffn.heartbeat_timeout_s" in cause


def test_a_configured_heartbeat_timeout_is_the_bound() -> None:
    """The bound is the configured one, not a constant: 5 s declares the same silence dead."""
    clock = _Clock()
    _, recovery = _recovery(AFDConfig.model_validate({"ffn": {"heartbeat_timeout_s": 5}}), clock)
    recovery.heard(0, LoopState.SERVING)
    clock.now += 4.9
    assert recovery.dead(None) == {}
    clock.now += 0.2
    assert list(recovery.dead(None)) == [0]
