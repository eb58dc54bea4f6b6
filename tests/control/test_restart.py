"""A coordinator restarted by Serve while its members keep serving (DESIGN §12), in
the middle of an FFN recovery among others, without Ray: the real registry and
recovery, fed the records the members re-register with (`rejoin_ffn`,
`rejoin_attention`) and the reports they send, on Serve replica states the test sets."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from afd_ray.config import AFDConfig
from afd_ray.connector.channel import FFNAddress
from afd_ray.control.membership import AttentionMember, FFNMember, LoopState, MemberState
from afd_ray.control.recovery import Recovery
from afd_ray.control.registry import Registry
from afd_ray.control.resize import Resizer

READY = MemberState.READY
SERVING = LoopState.SERVING
ADDRESS = FFNAddress("127.0.0.1", 1, 2)
WITHIN_S = 20.0
"""Bound on every wait of these tests (they take about a second each)."""


def _ffn(rank: int, epoch: int, layout: tuple[int, ...], loop: LoopState = SERVING) -> FFNMember:
    """FFN rank `rank` as it rejoins: serving the layout `layout` of `epoch`."""
    return FFNMember(rank=rank, address=ADDRESS, replica=f"ffn#{rank}", state=READY, epoch=epoch,
                     ep_rank=layout.index(rank), loop=loop)  # fmt: skip


def _attention(rank: int, ffn_peer: int, epoch: int) -> AttentionMember:
    return AttentionMember(rank=rank, ffn_peer=ffn_peer, state=READY, epoch=epoch, replica=f"a#{rank}",
                           peered_epoch=epoch)  # fmt: skip


def test_an_attention_rank_naming_an_unknown_ffn_peer_gets_no_assignment() -> None:
    """EP2 layout (0, 1) of epoch 3: FFN rank 1 died while the old coordinator
    recovered from it; attention rank 0, still peered with it, rejoins the restarted
    coordinator, which never heard of rank 1. Its poll is answered (its state, no
    assignment: it keeps the pairing it holds) instead of raising; an attention rank
    the registry does not know gets None (rejoin). Before, `attention_poll` raised
    KeyError: 1 at every poll of that rank."""
    registry = Registry("gloo", 5.0, 2)
    registry.rejoin_attention(_attention(0, ffn_peer=1, epoch=3))
    directive = registry.attention_directive(0)
    assert directive is not None and directive.state is READY and directive.assignment is None
    assert registry.attention_directive(7) is None
    registry.rejoin_ffn(_ffn(1, 3, (0, 1)), 2)
    directive = registry.attention_directive(0)
    assert directive is not None and directive.assignment is not None and directive.assignment.ffn_rank == 1


def test_a_restarted_coordinator_never_reuses_an_ffn_rank_id() -> None:
    """FFN rank 1 of the EP2 layout (0, 1) died before the restart. A new FFN rank
    (Serve's replacement) must not get id 1 while attention rank 0 still names 1 as
    its peer. Before, new ids were max(known FFN ranks) + 1, so the replacement got
    1: attention rank 0's peer became the replacement, under its old pairing epoch."""
    registry = Registry("gloo", 5.0, 2)
    registry.rejoin_attention(_attention(0, ffn_peer=1, epoch=3))
    registry.rejoin_ffn(_ffn(0, 3, (0, 1)), 2)
    assert registry.add_ffn(ADDRESS, "ffn#2") == 2


class _Serve:
    """Serve's replica states of the FFN deployment, as the test sets them."""

    def __init__(self, *replicas: str) -> None:
        self.states = dict.fromkeys(replicas, "RUNNING")

    async def __call__(self, app: str, deployment: str) -> dict[str, str]:
        return dict(self.states)


async def _until(condition: Callable[[], bool], within_s: float = WITHIN_S) -> None:
    """Poll `condition` until it holds (bounded: fails past `within_s` seconds)."""
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def _coordinator(serve: _Serve, num_ffn: int) -> tuple[Registry, Recovery]:
    """A restarted coordinator's registry and recovery (FFN target `num_ffn`)."""
    cfg = AFDConfig.model_validate({"ffn": {"num_ranks": num_ffn}, "attention": {"num_ranks": 2}})
    registry = Registry("gloo", cfg.connector.timeout_s, num_ffn)
    resizer = Resizer(registry, "afd", cfg.attention, cfg.ffn, cfg.autoscale, replicas=serve)
    recovery = Recovery(registry, resizer, "afd", cfg.ffn.heartbeat_timeout_s, 10.0, replicas=serve)
    return registry, recovery


def test_a_stray_attention_rank_is_moved_onto_the_layout() -> None:
    """1F: FFN rank 0 died and the old coordinator's recovery switched to its
    replacement, rank 1, and re-peered attention rank 0 with it; the coordinator
    restarted before attention rank 0 followed, so it rejoins peered with the dead
    rank 0. Once the layout (1,) rejoined, the restarted coordinator moves it onto
    rank 1 under a newer epoch. Before, nothing moved it: its requests waited for a
    new peer until `connector.peer_lost_wait_s`, then failed."""
    serve = _Serve("ffn#1")
    registry, recovery = _coordinator(serve, 1)

    async def run() -> None:
        watch = asyncio.create_task(recovery.watch())
        try:
            registry.rejoin_attention(_attention(0, ffn_peer=0, epoch=4))
            registry.rejoin_ffn(_ffn(1, 5, (1,)), 1)
            await _until(lambda: registry.attention[0].ffn_peer == 1)
        finally:
            watch.cancel()

    asyncio.run(run())
    assert registry.attention[0].epoch > 5 and registry.layout == (1,) and not recovery.events
