"""`gloo` / `nccl` / `hccl`: the data plane of a pair over 2-rank stateless process
groups (FFN rank 0, attention rank 1), one group per micro-batch.

Each tensor of a message is one point-to-point send with a fixed tag: A2F hidden
states, top-k ids, top-k weights (1, 3, 4), F2A output (2). The groups rendezvous
through the pair's prefix store (`afd_ray.connector.process_group.new_process_group`).

Release on `close()`: gloo has no call that cancels a posted receive, but a wait that
times out closes its TCP pair, which fails every other wait on it at once and shows
the peer a closed connection (`GroupPair.close`). NCCL/HCCL waits end when their peer
closes or at `timeout_s`.

CUDA (`nccl`): every call returns at once on the host; it is queued on the group's
NCCL stream after the work already queued on the caller's current CUDA stream, and
`Work.wait()` makes the caller's current stream wait for it (no host wait). The ops
of one group run in order on one stream, so a receive queued before a send of the
same group deadlocks: send A2F first, then receive F2A.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from afd_ray.connector.link import PeerLostError, contiguous
from afd_ray.connector.pair import Side
from afd_ray.connector.process_group import new_process_group
from afd_ray.platform import Backend

__all__ = ["GroupPair", "open_group_pair"]

_A2F_TAGS = (1, 3, 4)
"""Process-group tags of the A2F tensors: hidden states, top-k ids, top-k weights."""
_F2A_TAGS = (2,)
_CLOSE_TAG = 5
"""Tag of the receive whose timeout closes a gloo pair (`GroupPair.close`); never sent."""
_CLOSE_WAIT = timedelta(milliseconds=1)
"""How long closing waits on that receive; its timeout is what closes the pair."""


class _Works:
    """`Pending` over process-group `Work`s; failures become `PeerLostError` ("pair
    closed" once the pair was closed, before or during the wait)."""

    def __init__(self, works: list[dist.Work], pair: GroupPair) -> None:
        self._works, self._pair = works, pair

    def wait(self) -> None:
        try:
            for work in self._works:
                work.wait()
        except RuntimeError as exc:
            raise self._pair.lost(exc) from exc


class GroupPair:
    """One side of a pair's data plane over process groups, a `Pair` (built by
    `open_group_pair`).

    Args:
        side: `attention` (sends A2F, receives F2A) or `ffn` (the reverse).
        groups: the pair's 2-rank groups, one per ubatch.
        peer: attention rank id of the pair (for errors).
        backend: the groups' backend.
    """

    def __init__(self, side: Side, groups: list[dist.ProcessGroup], peer: int, backend: Backend) -> None:
        self._groups, self._peer, self._backend = groups, peer, backend
        self._other = 0 if side == "attention" else 1
        self._send_tags, self._recv_tags = (_A2F_TAGS, _F2A_TAGS) if side == "attention" else (_F2A_TAGS, _A2F_TAGS)
        self._closed = False

    def send(self, tensors: Sequence[torch.Tensor], ubatch: int) -> _Works:
        contiguous(tensors)
        group = self._open(ubatch)
        try:
            return _Works([group.send([t], self._other, tag) for t, tag in zip(tensors, self._send_tags)], self)
        except RuntimeError as exc:
            raise self.lost(exc) from exc

    def recv(self, outs: Sequence[torch.Tensor], ubatch: int) -> _Works:
        contiguous(outs)
        group = self._open(ubatch)
        try:
            return _Works([group.recv([t], self._other, tag) for t, tag in zip(outs, self._recv_tags)], self)
        except RuntimeError as exc:
            raise self.lost(exc) from exc

    def exchange(self, sends: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], ubatch: int) -> None:
        """Sends then the answer. With gloo the receive is posted first, so the FFN
        never waits on us; with NCCL it is queued after the sends (one stream)."""
        if self._backend == "gloo":
            recv = self.recv(outs, ubatch)
            self.send(sends, ubatch).wait()
            recv.wait()
            return
        self.send(sends, ubatch).wait()
        self.recv(outs, ubatch).wait()

    def lost(self, exc: RuntimeError) -> PeerLostError:
        """The error of a failed call or wait: "pair closed" once `close()` ran (it
        fails the waits it releases), else the backend's reason."""
        return PeerLostError(self._peer, "pair closed" if self._closed else str(exc))

    def _open(self, ubatch: int) -> dist.ProcessGroup:
        if self._closed:
            raise PeerLostError(self._peer, "pair closed")
        return self._groups[ubatch]

    def close(self) -> None:
        """Close the pair's connections and release every wait on them, also one
        blocked in another thread; every call and wait afterwards fails with
        `PeerLostError` "pair closed". Idempotent.

        gloo has no call that cancels a posted receive (`abort()`/`shutdown()` leave
        it waiting, and data arriving later is still written into its buffer), but a
        wait that times out closes its TCP pair (gloo's "Application timeout caused
        pair closure"), which fails every other wait on that pair at once and shows
        the peer a closed connection: so closing waits 1 ms on a receive of a tag
        nobody sends. The pair's buffers are never written afterwards."""
        if self._closed:
            return
        self._closed = True
        for group in self._groups:
            if self._backend == "gloo":
                try:
                    nothing = torch.empty(1, dtype=torch.uint8, device="cpu")
                    group.recv([nothing], self._other, _CLOSE_TAG).wait(_CLOSE_WAIT)
                except RuntimeError:
                    pass  # the expected timeout, or the pair was closed already (the peer closed or died)
            group.shutdown()


def open_group_pair(
    side: Side, store: dist.Store, peer: int, ubatches: int, timeout_s: float, backend: Backend
) -> GroupPair:
    """Open one side of a pair's process-group data plane; blocks until the other side
    opened its own (bounded by `timeout_s`).

    Args:
        side: this process's side; the FFN is rank 0, the attention rank 1.
        store: the pair's prefix store; each ubatch's group rendezvouses under
            `ubatch<u>` in it.
        peer: attention rank id of the pair.
        ubatches: groups to open, one per micro-batch.
        timeout_s: bound on the rendezvous and on every receive, seconds.
        backend: `gloo`, `nccl` or `hccl`.

    Raises:
        PeerLostError: the rendezvous failed or timed out.
    """
    rank = 1 if side == "attention" else 0
    try:
        groups = [
            new_process_group(backend, dist.PrefixStore(f"ubatch{u}", store), rank, 2, timeout_s)
            for u in range(ubatches)
        ]
    except RuntimeError as exc:  # DistStoreError included
        raise PeerLostError(peer, f"{backend} rendezvous failed ({exc})") from exc
    return GroupPair(side, groups, peer, backend)
