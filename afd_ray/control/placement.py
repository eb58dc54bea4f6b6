"""Pure placement functions of the coordinator: which FFN rank an attention rank peers
with, which attention ranks move when the FFN layout changes, and pool-size bounds.

No Ray, no asyncio, no state: each function maps membership records to a decision,
so the resize orchestration and the unit tests run the same code.

Balance invariant: A live attention ranks over F FFN ranks give each FFN rank
floor(A/F) or ceil(A/F) peers (every attention rank that is not GONE counts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from afd_ray.config import AttentionPoolConfig, FFNPoolConfig
from afd_ray.control.membership import AttentionMember, FFNMember, MemberState

__all__ = [
    "check_sizes",
    "clamp",
    "joining",
    "least_loaded",
    "live_count",
    "live_ranks",
    "peer_load",
    "rebalance_moves",
    "reformed_layout",
    "serving_ffn",
    "stands_by",
    "stray_moves",
    "takers",
]


def peer_load(attention: Mapping[int, AttentionMember], ranks: Sequence[int]) -> dict[int, int]:
    """Attention peers that are not GONE of each FFN rank in `ranks` (a peer of an FFN
    rank outside `ranks` is not counted)."""
    load = {rank: 0 for rank in ranks}
    for member in attention.values():
        if member.state is not MemberState.GONE and member.ffn_peer in load:
            load[member.ffn_peer] += 1
    return load


def least_loaded(load: Mapping[int, int]) -> int:
    """The FFN rank with the fewest peers in `load` (lowest rank on ties).

    Raises:
        ValueError: `load` is empty.
    """
    return min(load, key=lambda rank: (load[rank], rank))


def rebalance_moves(attention: Mapping[int, AttentionMember], ranks: Sequence[int]) -> list[tuple[int, int]]:
    """The moves `(attention rank, new FFN peer)`, in order, that leave no READY
    attention rank on an FFN rank outside `ranks` and give each rank of `ranks`
    floor(A/F) or ceil(A/F) peers.

    Each step moves one READY rank: first one peered outside `ranks` (lowest attention
    rank first), else the lowest READY rank of the busiest FFN rank that has a READY
    peer (lowest FFN rank on ties) while it has two or more peers more than the idlest;
    it goes to the idlest FFN rank (lowest on ties). STARTING and DRAINING ranks count
    in the load but do not move (so the balance holds among movable ranks only). A rank
    may appear more than once; its last move is where it ends.

    Raises:
        ValueError: `ranks` is empty.
    """
    peers = dict(attention)
    moves: list[tuple[int, int]] = []
    while True:
        load = peer_load(peers, ranks)
        ready = [peers[r] for r in sorted(peers) if peers[r].state is MemberState.READY]
        stray = [m for m in ready if m.ffn_peer not in load]
        donors = {m.ffn_peer for m in ready if m.ffn_peer in load}
        busiest = max(donors, key=lambda r: (load[r], -r), default=None)
        idlest = least_loaded(load)
        if stray:
            member = stray[0]
        elif busiest is not None and load[busiest] - load[idlest] > 1:
            member = next(m for m in ready if m.ffn_peer == busiest)
        else:
            return moves
        peers[member.rank] = member.model_copy(update={"ffn_peer": idlest})
        moves.append((member.rank, idlest))


def stray_moves(attention: Mapping[int, AttentionMember], ranks: Sequence[int]) -> list[tuple[int, int]]:
    """The moves `(attention rank, new FFN peer)` of the READY attention ranks peered
    with an FFN rank outside `ranks` (lowest attention rank first), each to the least
    loaded rank of `ranks` then (lowest on ties); no other rank moves.

    Raises:
        ValueError: `ranks` is empty and a rank must move.
    """
    peers = dict(attention)
    moves: list[tuple[int, int]] = []
    for rank, member in sorted(attention.items()):
        if member.state is MemberState.READY and member.ffn_peer not in ranks:
            peer = least_loaded(peer_load(peers, ranks))
            peers[rank] = member.model_copy(update={"ffn_peer": peer})
            moves.append((rank, peer))
    return moves


def reformed_layout(old: Sequence[int], live: Sequence[int], joining: Sequence[int], target: int) -> tuple[int, ...]:
    """The EP order of a layout re-formed after ranks of `old` were lost: every rank
    of `old` still in `live` keeps its EP rank below `target` (so it reloads no
    expert); the lost slots go to the other ranks of `live` (first those of `old`
    past `target`, when the target shrank meanwhile), then to `joining`, in order,
    and the layout is filled up to `target` ranks. With too few ranks left the
    layout is smaller and its EP ranks close up (0..n-1)."""
    spare = iter([*(r for r in old[target:] if r in live), *(r for r in live if r not in old), *joining])
    slots = [r if r in live else next(spare, None) for r in old[:target]]
    slots += [r for r in spare][: target - len(slots)]
    return tuple(r for r in slots if r is not None)


def joining(ffn: Mapping[int, FFNMember], layout: Sequence[int]) -> tuple[int, ...]:
    """FFN ranks registered (STARTING) and not in `layout`, in rank order."""
    return tuple(r for r, m in sorted(ffn.items()) if m.state is MemberState.STARTING and r not in layout)


def takers(ffn: Mapping[int, FFNMember], layout: Sequence[int]) -> tuple[int, ...]:
    """FFN ranks outside `layout` that a re-formed or grown layout may take in, best
    first: STANDBY ranks that have reported (loaded and listening: they join without
    loading anything), then STARTING ranks (`joining`: they load only their shard),
    then STANDBY ranks still loading; by rank within each."""
    standby = [r for r, m in sorted(ffn.items()) if m.state is MemberState.STANDBY and r not in layout]
    loaded = [r for r in standby if ffn[r].loop is not None]
    return (*loaded, *joining(ffn, layout), *(r for r in standby if r not in loaded))


def stands_by(
    ffn: Mapping[int, FFNMember], layout: Sequence[int], planned: Sequence[int], target: int, standby_ranks: int
) -> bool:
    """Whether a newly registered FFN rank stands by (STANDBY, every expert, outside the
    layout) rather than joining the layout (STARTING, its shard only): with
    `standby_ranks` > 0, unless the `target` FFN ranks are not reached by the ranks of
    `layout`, of a pending plan (`planned`) and the other `takers` together (a loss or
    a scale-out still needs a rank, and this one comes first)."""
    if standby_ranks == 0:
        return False
    placed = set(layout) | set(planned)
    return len(placed) + sum(r not in placed for r in takers(ffn, layout)) >= target


def serving_ffn(ffn: Mapping[int, FFNMember]) -> list[int]:
    """FFN ranks that are neither GONE nor STANDBY: what the autoscaling signals count
    (a standby serves nothing and is no capacity)."""
    return [r for r, m in ffn.items() if m.state not in (MemberState.GONE, MemberState.STANDBY)]


def live_ranks(members: Mapping[int, AttentionMember] | Mapping[int, FFNMember]) -> list[int]:
    """Ranks of `members` that are not GONE."""
    return [rank for rank, member in members.items() if member.state is not MemberState.GONE]


def live_count(members: Mapping[int, AttentionMember] | Mapping[int, FFNMember]) -> int:
    """Members that are STARTING or READY (what a pool size counts)."""
    return sum(m.state in (MemberState.STARTING, MemberState.READY) for m in members.values())


def check_sizes(attention: int, ffn: int, attention_pool: AttentionPoolConfig, ffn_pool: FFNPoolConfig) -> None:
    """Raises ValueError naming the field when a pool size is outside its pool's
    `min_ranks`..`max_ranks`."""
    for name, value, pool in (("attention", attention, attention_pool), ("ffn", ffn, ffn_pool)):
        if not pool.min_ranks <= value <= pool.upper:
            raise ValueError(
                f"{name}: {value} is outside [{pool.min_ranks}, {pool.upper}] ({name}.min_ranks, {name}.max_ranks)"
            )


def clamp(target: int, pool: AttentionPoolConfig | FFNPoolConfig) -> int:
    """`target` within `pool.min_ranks`..`pool.upper`."""
    return min(max(target, pool.min_ranks), pool.upper)
