"""`cuda_ipc`: the data plane of a pair whose two processes run on GPUs of one node,
including both on ONE GPU (NCCL refuses that: "Duplicate GPU detected").

Memory: each side allocates one torch symmetric-memory buffer (CUDA backend: cuMem
allocations exchanged over CUDA IPC, multicast off) and maps the other side's
(`rendezvous` over the pair's registered gloo group, `afd_ray.connector.process_group`).
Two processes on one GPU are allowed through `afd_ray.compat.allow_symm_mem_shared_device`.
Each buffer holds, per micro-batch `u`, two slots of `SLOT_BYTES`:

    [ A2F slot u=0 | F2A slot u=0 | A2F slot u=1 | F2A slot u=1 | ... ]

The FFN side's A2F slots and the attention side's F2A slots are the ones written.

Send (`send`): copy the message's tensors, each at a 16-byte aligned offset, into the
PEER's slot of this direction (device copies through the peer mapping), then raise the
slot's flag in the peer's signal pad (`put_signal`: a one-thread kernel, a release
compare-and-swap 0 -> 1 at system scope). Receive (`recv`): make the current stream
wait for the flag (`wait_signal`: acquire 1 -> 0), then copy the tensors out of this
side's own slot into the caller's `out` tensors. Everything is queued on the caller's
current CUDA stream and returns at once on the host, so `Pending.wait()` has nothing
left to do, and a step of either side can be captured in a CUDA graph (the flags are
consumed by each wait, so a graph replays any number of times).

Why it is safe to reuse a slot: the link contract (`afd_ray.connector.link`)
alternates A2F and F2A per ubatch, so a side writes a slot of the peer again only
after it received the peer's answer, which the peer raised after its copy out of that
slot (same stream, earlier).

Several pairs per process: torch numbers the store exchanges of its symmetric-memory
rendezvous with one counter per process, not per group, so an FFN rank's second pair
(a second attention peer, or a re-peered one) would wait for keys its fresh peer
never writes (seen on an H200: 2A:1F timed out in the rendezvous). `open_cuda_ipc_pair`
therefore has each side publish how many rendezvous its process ran, and the side
behind runs that many one-rank rendezvous first (`_catch_up`), so that both sides'
counters agree. It assumes nothing else in the process rendezvous symmetric memory
(vLLM does only with TP > 1, which the attention engine does not use).

Opening a pair never waits on the caller's streams: a process that already serves
other pairs has device-side flag waits queued on its serving stream, for messages
that may come only later, and torch (seen: 2.11) zeroes a new allocation's signal
pad on the current stream and synchronizes that stream, and the barrier is queued
on the current stream and waited for. So the allocation, the rendezvous and the barrier run on a stream of their own
(`_setup_stream`), synchronized alone; the serving stream should be a non-blocking
one (`afd_ray.ffn.runtime`), as the legacy default stream is ordered with every
blocking stream. (2A:1F on an H200: the FFN rank opened its second pair in its loop
thread, on the legacy default stream that held the first pair's step.)

Opening checks the mapping before any device-side signal (`_check_mapping`): each
side marks its own buffer and signal pad, and after a host barrier reads the peer's
marks through its mappings. A wrong mapping is then a `RuntimeError` on both sides
at once, naming what was read, instead of a barrier that traps after `timeout_ms`.
(2A:1F on an H200: the FFN rank's barrier with its second attention rank never got
that rank's signal, while the attention side got the FFN's.)

Failure: every flag wait and put is bounded by `timeout_ms` on the device; past it
torch's kernel traps, which ends the CUDA context of that process (the replica then
fails and Serve restarts it): a dead peer is never waited on forever, but is
detected only after the timeout.

Two processes on one GPU need NVIDIA MPS for microsecond round trips: without it the
GPU time-slices between the two contexts (measured on one H200: 4.5 ms per round trip
without MPS, 7.1-7.6 us in a CUDA graph with MPS, T = 1..128, H = 2048 bf16).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from afd_ray.compat import allow_symm_mem_shared_device
from afd_ray.connector.pair import Done, Side
from afd_ray.connector.process_group import registered_gloo_group, unregister_group
from afd_ray.devices import pooled_stream_other_than

__all__ = ["SLOT_BYTES", "CudaIpcPair", "open_cuda_ipc_pair"]

SLOT_BYTES = 64 << 20
"""Bytes of one slot (one direction of one ubatch): `[T, H]` bfloat16 rows up to
T * H * 2 <= 64 MiB (T = 16384 at H = 2048), plus the top-k tensors; a split MoE
output `[T, 2, H]` (`afd_ray.connector.link`) up to T = 8192 at H = 2048."""
_ALIGN = 16
_BARRIER_CHANNEL = 0


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class CudaIpcPair:
    """One side of a pair's CUDA-IPC data plane, a `Pair` (built by `open_cuda_ipc_pair`).

    Args:
        side: `attention` or `ffn`.
        group: the pair's 2-rank registered gloo group (FFN rank 0, attention rank 1).
        ubatches: slots per direction, one per micro-batch in flight.
        device: this side's CUDA device.
        timeout_ms: device-side bound on every flag wait and put, and on the barrier
            that ends the opening (past it the barrier traps, module docstring).
        slot_bytes: bytes of one slot.

    Opening waits for no work queued on the caller's streams (module docstring);
    `send`/`recv` then queue on the caller's current stream.

    Raises:
        ValueError: `device` is not CUDA, or `ubatches` < 1.
        RuntimeError: the rendezvous failed (from torch).
    """

    def __init__(
        self,
        side: Side,
        group: dist.ProcessGroup,
        ubatches: int,
        device: torch.device,
        timeout_ms: int,
        slot_bytes: int = SLOT_BYTES,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"cuda_ipc needs a CUDA device, got {device}")
        if ubatches < 1:
            raise ValueError(f"ubatches must be >= 1, got {ubatches}")
        self.side = side
        self.ubatches = ubatches
        self.slot_bytes = slot_bytes
        self.timeout_ms = timeout_ms
        self._group = group
        numel = 2 * ubatches * slot_bytes
        allow_symm_mem_shared_device()
        with _setup_stream(device) as stream:
            self._buffer = symm_mem.empty(numel, dtype=torch.uint8, device=device)
            self._handle = _rendezvous_once(self._buffer, group)
            self._peer = 1 - self._handle.rank
            self._peer_buffer = self._handle.get_buffer(self._peer, (numel,), torch.uint8, 0)
            self._check_mapping(stream)
            self._handle.barrier(_BARRIER_CHANNEL, timeout_ms)
            stream.synchronize()

    def _check_mapping(self, stream: torch.cuda.Stream) -> None:
        """Check, before the first device-side signal, that this side's mappings of the
        peer's buffer and signal pad show the peer's own memory (module docstring).

        Each side writes a mark into its own memory: `[pid, rank + 1]` (int64) at the
        start of the slot it receives on, and its pid (mod 2**31) in the pad entry
        where the peer would signal it on the last channel (which no message uses).
        After a host barrier (a gloo all-gather of the pids over the pair's group),
        each side reads the peer's marks through its mappings; a second all-gather
        shares the verdicts. Only reads cross the mappings, so a wrong mapping touches
        nothing of another pair.

        Raises:
            RuntimeError: either side read something else than the peer's marks (says
                what this side read and expected).
        """
        rank, peer, pid = self._handle.rank, self._peer, os.getpid()
        own_pad = self._handle.get_signal_pad(rank).view(torch.int32)
        entry = own_pad.numel() - 2 + peer  # world size 2: last channel, from the peer
        self._slot(self._buffer, 1 - self._send_direction, 0)[:16].view(torch.int64).copy_(
            torch.tensor([pid, rank + 1], dtype=torch.int64, device="cpu")
        )
        own_pad[entry : entry + 1].fill_(pid % 2**31)
        stream.synchronize()
        pids = _allgather(self._group, pid)
        expected = [pids[peer], peer + 1]
        got = self._slot(self._peer_buffer, self._send_direction, 0)[:16].view(torch.int64).tolist()
        peer_pad = self._handle.get_signal_pad(peer).view(torch.int32)
        signal = int(peer_pad[peer_pad.numel() - 2 + rank].item())
        ok = got == expected and signal == pids[peer] % 2**31
        verdicts = _allgather(self._group, int(ok))
        if all(verdicts):
            return
        if ok:
            raise RuntimeError(f"cuda_ipc pair: the peer (pid {pids[peer]}) does not see this side's memory")
        raise RuntimeError(
            f"cuda_ipc pair ({self.side} side, pid {pid}): the mapping of the peer's (pid {pids[peer]}) buffer reads "
            f"{got}, expected {expected}; of its signal pad {signal}, expected {pids[peer] % 2**31}: the "
            "rendezvous mapped other memory than the peer's"
        )

    def _slot(self, buffer: torch.Tensor, direction: int, ubatch: int) -> torch.Tensor:
        if not 0 <= ubatch < self.ubatches:
            raise ValueError(f"ubatch {ubatch} outside [0, {self.ubatches})")
        start = (2 * ubatch + direction) * self.slot_bytes
        return buffer[start : start + self.slot_bytes]

    def _channel(self, direction: int, ubatch: int) -> int:
        return 1 + 2 * ubatch + direction

    @property
    def _send_direction(self) -> int:
        return 0 if self.side == "attention" else 1  # 0: A2F, 1: F2A

    def _views(self, slot: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Where each of `tensors` lies in `slot` (aligned, in order)."""
        views, offset = [], 0
        for tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if offset + nbytes > self.slot_bytes:
                raise ValueError(f"message of {offset + nbytes} bytes exceeds the {self.slot_bytes}-byte slot")
            views.append(slot[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape))
            offset = _aligned(offset + nbytes)
        return views

    def send(self, tensors: Sequence[torch.Tensor], ubatch: int) -> Done:
        """Queue the message `tensors` (contiguous, on this device) to the peer's slot of
        `ubatch`, then its flag; the tensors may be changed once later work on the
        current stream runs.

        Raises:
            ValueError: the message exceeds a slot, or `ubatch` is out of range.
        """
        direction = self._send_direction
        for view, tensor in zip(self._views(self._slot(self._peer_buffer, direction, ubatch), tensors), tensors):
            view.copy_(tensor)
        self._handle.put_signal(self._peer, self._channel(direction, ubatch), self.timeout_ms)
        return Done()

    def recv(self, outs: Sequence[torch.Tensor], ubatch: int) -> Done:
        """Queue the wait for the peer's message on `ubatch` and the copies into `outs`
        (contiguous, exact shapes and dtypes of what the peer sends)."""
        direction = 1 - self._send_direction
        self._handle.wait_signal(self._peer, self._channel(direction, ubatch), self.timeout_ms)
        for view, out in zip(self._views(self._slot(self._buffer, direction, ubatch), outs), outs):
            out.copy_(view)
        return Done()

    def exchange(self, sends: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], ubatch: int) -> None:
        """`send(sends)` then `recv(outs)` on `ubatch` (the attention side's layer)."""
        self.send(sends, ubatch)
        self.recv(outs, ubatch)

    def close(self) -> None:
        """Forget the pair's group name; the buffers go with this object."""
        unregister_group(self._group.group_name)


def _allgather(group: dist.ProcessGroup, value: int) -> list[int]:
    """`value` of every rank of `group` (gloo, host tensors), by rank; a host barrier.

    The tensors are on the host explicitly: vLLM's GPU worker builds (and connects) the
    model under a CUDA default device, where a bare `torch.tensor` is a CUDA tensor that
    gloo refuses ("No backend type associated with device type cuda": every served
    cuda_ipc pair failed so on the H100 run of 2026-12-07)."""
    outs = [torch.empty(1, dtype=torch.int64, device="cpu") for _ in range(group.size())]
    group.allgather([outs], [torch.tensor([value], dtype=torch.int64, device="cpu")]).wait()
    return [int(out.item()) for out in outs]


_rendezvous = 0
"""Symmetric-memory rendezvous this process ran (`_catch_up`)."""

_catch_up_buffers: list[torch.Tensor] = []
"""The one-rank rendezvous' buffers, kept for the process's life (one allocation
granule each, 2 MiB on an H200): torch synchronizes the whole device when it frees
one (`cudaDeviceSynchronize` in its `AllocationRef`), which would wait for the flag
waits queued on the process's serving stream."""


@contextmanager
def _setup_stream(device: torch.device) -> Iterator[torch.cuda.Stream]:
    """A non-blocking stream of `device` other than the caller's current one (the FFN
    loop's serving stream when it admits a peer), current inside the block: pair
    setup queues nothing behind the caller's work (module docstring). Other pooled
    streams the process queues on may still be drawn (torch's pool is round-robin)."""
    stream = pooled_stream_other_than(device, torch.cuda.current_stream(device).cuda_stream)
    with torch.cuda.stream(stream):
        yield stream


def _rendezvous_once(buffer: torch.Tensor, group: dist.ProcessGroup) -> symm_mem._SymmetricMemory:
    global _rendezvous
    handle = symm_mem.rendezvous(buffer, group.group_name)
    _rendezvous += 1
    return handle


def _catch_up(side: Side, store: dist.Store, device: torch.device, timeout_s: float) -> None:
    """Agree with the other side of the pair on torch's per-process rendezvous counter:
    publish this process's count in `store`, read the other's, and if it is ahead run
    as many one-rank rendezvous (module docstring)."""
    other = "attention" if side == "ffn" else "ffn"
    store.set(f"ipc/rendezvous/{side}", str(_rendezvous))
    store.wait([f"ipc/rendezvous/{other}"], timedelta(seconds=timeout_s))
    behind = int(store.get(f"ipc/rendezvous/{other}").decode()) - _rendezvous
    for _ in range(behind):
        name = f"afd-ipc-catch-up-{uuid.uuid4().hex[:12]}"
        group = registered_gloo_group(dist.HashStore(), 0, 1, timeout_s, name)
        try:
            with _setup_stream(device):
                _catch_up_buffers.append(symm_mem.empty(16, dtype=torch.uint8, device=device))
                _rendezvous_once(_catch_up_buffers[-1], group)
        finally:
            unregister_group(name)


def open_cuda_ipc_pair(side: Side, store: dist.Store, peer: int, ubatches: int, timeout_s: float) -> CudaIpcPair:
    """Open one side of attention rank `peer`'s CUDA-IPC pair on this process's current
    CUDA device (a collective: both sides call it with a store private to the pair,
    e.g. a `PrefixStore` of the pair's peer and epoch).

    The FFN side names the pair's group (unique in its process: it may hold pairs of
    many peers and epochs) and publishes the name in `store`.

    Raises:
        RuntimeError / DistStoreError: the other side did not rendezvous within `timeout_s`.
    """
    if side == "ffn":
        name = f"afd-ipc-{peer}-{uuid.uuid4().hex[:12]}"
        store.set("ipc/group", name)
    else:
        store.wait(["ipc/group"], timedelta(seconds=timeout_s))
        name = store.get("ipc/group").decode()
    device = torch.device("cuda", torch.cuda.current_device())
    _catch_up(side, store, device, timeout_s)
    group = registered_gloo_group(store, 0 if side == "ffn" else 1, 2, timeout_s, name)
    return CudaIpcPair(side, group, ubatches, device, int(timeout_s * 1000))
