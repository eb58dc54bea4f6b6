"""Step forming on its own: `StepFormer` over a stand-in link whose headers are queued
in advance (no transport, no threads). The runtime's tests (`test_runtime.py`) check
the same rules end to end over the real connector."""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from afd_ray.connector.header import HeaderKind, StepHeader
from afd_ray.ffn.step_former import FormedStep, StepFormer

STEP, JOIN, LEAVE = HeaderKind.STEP, HeaderKind.JOIN, HeaderKind.LEAVE


class _QueuedHeaders:
    """The two members of `FFNLink` a former uses: admitted `peers`, and `recv_header`
    returning the queued headers in order (None once they ran out)."""

    def __init__(self, peers: list[int], headers: list[StepHeader]) -> None:
        self.peers = peers
        self.waits: list[float] = []
        """The `timeout_s` of every `recv_header` call."""
        self._headers = deque(headers)

    def recv_header(self, timeout_s: float) -> StepHeader | None:
        self.waits.append(timeout_s)
        return self._headers.popleft() if self._headers else None


def _step(peer: int, step_id: int, tokens: int, first_layer: int = 0) -> StepHeader:
    return StepHeader(STEP, peer, 0, step_id, tokens, first_layer)


def _former(peers: list[int], *headers: StepHeader) -> StepFormer:
    return StepFormer(_QueuedHeaders(peers, list(headers)), batch_window_s=30.0, poll_s=0.01, idle_poll_s=0.08)


def _shape(step: FormedStep) -> tuple[list[tuple[int, int]], list[tuple[HeaderKind, int]]]:
    return [(s.peer, s.num_tokens) for s in step.steps], [(h.kind, h.peer) for h in step.membership]


def test_a_step_takes_every_admitted_peer_in_peer_order_and_carries_joins_and_leaves() -> None:
    former = _former([0, 1, 2], _step(2, 1, 4), StepHeader(JOIN, 5, 0), _step(0, 1, 3), _step(1, 1, 2))
    step = former.next()
    assert _shape(step) == ([(0, 3), (1, 2), (2, 4)], [(JOIN, 5)])
    assert step.tokens == 9 and step.first_layer == 0 and set(step.arrived) == {0, 1, 2}
    assert former.next() == FormedStep()  # nothing left


def test_a_peers_second_step_header_starts_the_next_step() -> None:
    """An attention rank whose host runs ahead announces its next step while the
    window still waits for peer 2: the first step closes without it, the second
    header starts the next one (with peer 2)."""
    former = _former([0, 2], _step(0, 1, 3), _step(0, 2, 5), _step(2, 1, 4))
    assert _shape(former.next()) == ([(0, 3)], [])
    assert _shape(former.next()) == ([(0, 5), (2, 4)], [])


def test_a_step_of_another_first_layer_starts_the_next_step() -> None:
    former = _former([0, 1], _step(0, 1, 3), _step(1, 1, 2, first_layer=1))
    assert _shape(former.next()) == ([(0, 3)], [])
    resumed = former.next()
    assert _shape(resumed) == ([(1, 2)], []) and resumed.first_layer == 1


def test_a_held_step_comes_back_first_without_its_joins() -> None:
    former = _former([0, 1], StepHeader(LEAVE, 1, 0), _step(0, 1, 3), _step(0, 2, 6))
    assert _shape(former.next()) == ([], [(LEAVE, 1)])
    step = former.next()
    former.hold(replace(step, membership=(StepHeader(JOIN, 4, 0),)))  # applied at this boundary
    assert _shape(former.next()) == ([(0, 3)], [])
    former.reset()  # an EP loss also forgets the deferred step of peer 0
    assert former.next() == FormedStep()


def test_ubatches_deal_peers_round_robin() -> None:
    step = FormedStep(tuple(_step(peer, 1, peer + 1) for peer in range(5)))
    assert [[s.peer for s in group] for group in step.ubatches(2)] == [[0, 2, 4], [1, 3]]
    assert [[s.peer for s in group] for group in step.ubatches(9)] == [[0], [1], [2], [3], [4]]
    assert FormedStep().ubatches(2) == [()]  # an EP rank without local rows runs one empty ubatch


def test_the_header_wait_doubles_while_idle_up_to_its_bound() -> None:
    link = _QueuedHeaders([], [])
    former = StepFormer(link, batch_window_s=30.0, poll_s=0.01, idle_poll_s=0.08)
    for active in (False, False, False, False, True):
        former.next()
        former.pace(active)
    former.next()
    assert link.waits == [0.01, 0.02, 0.04, 0.08, 0.08, 0.01]
