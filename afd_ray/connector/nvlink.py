"""A2F/F2A for one attention↔FFN pair over NVLink: one-sided writes into the peer's
symmetric memory, and device-side flags (no NCCL kernels, no host synchronization).

Each side allocates one symmetric buffer (`torch.distributed._symmetric_memory.empty`,
the CUDA backend: cuMem allocations shared through POSIX-fd CUDA IPC, multicast off)
and maps the other side's buffer (`rendezvous` over a 2-rank process group). The
buffer holds, per ubatch slot `u`, an A2F region and an F2A region of
`[max_tokens, H]` each (`SlotLayout`); the FFN side's A2F regions and the attention
side's F2A regions are the ones written. A step of `T` rows uses the first `T` rows,
whatever its bucket: one step per pair and slot is in flight at a time, so the buckets
of a bucketed CUDA graph set can share the region (capture sees the same addresses).

A2F (attention → FFN), per layer and ubatch:
1. the attention rank writes `[T, H]` into the FFN rank's A2F region through the
   peer mapping (`send_a2f`: a copy-engine copy; or any kernel writing into
   `a2f_target`, then `commit_a2f`);
2. it raises flag `a2f_channel(u)` in the FFN's signal pad (`put_signal`);
3. the FFN rank's stream waits on that flag (`recv_a2f`: `wait_signal`) and reads the
   rows from its own buffer. F2A is the same in the other direction (`send_f2a` /
   `f2a_target` + `commit_f2a`, `recv_f2a`).

Primitives (Python signatures checked on torch 2.11; kernel semantics from
`torch/csrc/distributed/c10d/symm_mem/CUDASymmetricMemory*.cu[h]`): the handle's
`get_buffer(rank, sizes, dtype, storage_offset)` (a view of a rank's buffer at an
element offset), `put_signal(dst_rank, channel, timeout_ms)` and
`wait_signal(src_rank, channel, timeout_ms)`: one-thread kernels on the caller's
current stream. The flag of (channel c, source s) is the uint32 at
`signal_pad[world_size * c + s]` of the destination. `put_signal` spins on a
compare-and-swap 0 → 1 with release semantics at system scope; `wait_signal` spins on
1 → 0 with acquire semantics, then `__threadfence_system()`. After `timeout_ms` either
kernel prints a message and traps (the CUDA context is lost: the process must be
restarted); 0 waits forever. Channel 0 is left to `barrier`.

Ordering guarantees:
- Visibility: the data write is queued before `put_signal` on the same stream, so it
  has completed when the release CAS runs; the release (cumulative, system scope)
  publishes it, and the waiter's acquire makes it visible to every later operation on
  the waiter's stream. This is the copy-then-signal pattern of torch's own
  symmetric-memory collectives (copy engine or kernel writes, then a signal kernel).
- Replays: the waiter consumes each flag (1 → 0), so every flag is 0 again once both
  sides have finished a step; a CUDA graph of a step can be replayed any number of
  times. A second `put_signal` before the first is consumed spins until it is (back
  pressure, never a lost signal). Each side must therefore issue, per channel, as many
  waits as the other issues puts.
- Reuse of a region (write after read): the attention rank writes the A2F region of
  slot `u` again only after it waited for the F2A of slot `u`, which the FFN raises
  after everything it queued before on its stream, reads of that A2F region
  included; symmetrically for F2A. So: queue the work that reads a received region on
  the stream that calls the next send, or join it to that stream before.
- Everything is queued on the current CUDA stream and returns at once on the host,
  so a whole step of either side can be captured in one CUDA graph (capture touches
  no peer: each side captures on its own).

Importing this module does not initialize CUDA; constructing a side does (a
collective: both ranks construct their side at the same time). Status: not yet run to
completion on a GPU (README, GPU benchmark); the slot layout is tested on CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed._symmetric_memory as symm_mem

from afd_ray.compat import allow_symm_mem_shared_device

__all__ = ["AttentionNVLink", "FFNNVLink", "SlotLayout"]

_BARRIER_CHANNEL = 0
_SYMM_MEM_BACKEND = "CUDA"
"""torch's own CUDA backend (cuMem + CUDA IPC), not NVSHMEM or NCCL windows. torch
registers it at load time unless the `TORCH_SYMMMEM` variable names another one
(`getSymmMemBackendCUDA`); `set_backend("CUDA")` then raises "does not find allocation
backend CUDA" (torch 2.11), so it is checked here, not set."""


@dataclass(frozen=True)
class SlotLayout:
    """Where the A2F/F2A regions of every ubatch slot lie in a side's symmetric buffer,
    and which signal channel each uses.

    Buffer of `numel` elements (model dtype), regions in slot order:
    `[A2F slot 0 | F2A slot 0 | A2F slot 1 | F2A slot 1 | ...]`, each `[max_tokens, H]`.
    Channels: 0 is `barrier`'s; slot `u` uses `1 + 2u` (A2F) and `2 + 2u` (F2A).

    Raises:
        ValueError: `max_tokens`, `hidden_size` or `ubatches` < 1.
    """

    max_tokens: int
    """Rows of each region: the largest step (bucket) of the pair."""
    hidden_size: int
    """H, elements per row."""
    ubatches: int = 1
    """Slots, one per micro-batch in flight (DBO: 2)."""

    def __post_init__(self) -> None:
        for name in ("max_tokens", "hidden_size", "ubatches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def region_numel(self) -> int:
        """Elements of one region, `max_tokens * H`."""
        return self.max_tokens * self.hidden_size

    @property
    def numel(self) -> int:
        """Elements of the whole buffer, `2 * ubatches * max_tokens * H`."""
        return 2 * self.ubatches * self.region_numel

    @property
    def channels(self) -> int:
        """Signal channels used, barrier's included."""
        return 1 + 2 * self.ubatches

    def a2f_offset(self, ubatch: int) -> int:
        """Element offset of the A2F region of `ubatch`."""
        return 2 * self._slot(ubatch) * self.region_numel

    def f2a_offset(self, ubatch: int) -> int:
        """Element offset of the F2A region of `ubatch`."""
        return (2 * self._slot(ubatch) + 1) * self.region_numel

    def a2f_channel(self, ubatch: int) -> int:
        """Signal channel of the A2F flag of `ubatch`."""
        return 1 + 2 * self._slot(ubatch)

    def f2a_channel(self, ubatch: int) -> int:
        """Signal channel of the F2A flag of `ubatch`."""
        return 2 + 2 * self._slot(ubatch)

    def check_tokens(self, num_tokens: int) -> None:
        """Raises ValueError unless `1 <= num_tokens <= max_tokens`."""
        if not 1 <= num_tokens <= self.max_tokens:
            raise ValueError(f"num_tokens {num_tokens} outside [1, {self.max_tokens}]")

    def _slot(self, ubatch: int) -> int:
        if not 0 <= ubatch < self.ubatches:
            raise ValueError(f"ubatch {ubatch} outside [0, {self.ubatches})")
        return ubatch


class _SymmetricPair:
    """One side's symmetric buffer, the peer's mapped buffer, and the flag kernels.

    Args:
        group_name: name of a 2-rank process group holding both sides
            (`ProcessGroup.group_name`; registered, e.g. the default group of
            `init_process_group`); its store carries the rendezvous.
        layout: regions and channels; identical on both sides.
        dtype: model dtype of the A2F/F2A tensors.
        device: this side's CUDA device.
        timeout_ms: bound on every flag wait and put, device-side (0: none).

    Raises:
        ValueError: a device that is not CUDA, `TORCH_SYMMMEM` naming a backend other
            than CUDA, or a group of other than 2 ranks.
        RuntimeError: the rendezvous or the peer mapping failed (from torch), or the
            buffer does not start its allocation (`get_buffer` offsets count from it).
    """

    def __init__(
        self,
        group_name: str,
        layout: SlotLayout,
        dtype: torch.dtype,
        device: torch.device,
        timeout_ms: int,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"the NVLink pair needs a CUDA device, got {device}")
        self.layout = layout
        self.dtype = dtype
        self.timeout_ms = timeout_ms
        backend = os.environ.get("TORCH_SYMMMEM", _SYMM_MEM_BACKEND)
        if backend != _SYMM_MEM_BACKEND:
            raise ValueError(f"TORCH_SYMMMEM={backend}: the NVLink pair needs torch's CUDA backend")
        allow_symm_mem_shared_device()  # both sides may run on one GPU (1-GPU layout)
        self._buffer = symm_mem.empty(layout.numel, dtype=dtype, device=device)
        self._handle = symm_mem.rendezvous(self._buffer, group_name)
        if self._handle.world_size != 2:
            raise ValueError(f"group {group_name} has {self._handle.world_size} ranks, a pair has 2")
        self.rank = self._handle.rank
        self.peer = 1 - self.rank
        own = self._handle.get_buffer(self.rank, (layout.numel,), dtype, 0)
        if own.data_ptr() != self._buffer.data_ptr():
            raise RuntimeError(
                "symmetric buffer is not at offset 0 of its allocation; peer views would be wrong"
            )
        self._peer_buffer = self._handle.get_buffer(self.peer, (layout.numel,), dtype, 0)
        """The peer's whole buffer (same offset, symmetric), mapped into this device's address space."""
        self._handle.barrier(_BARRIER_CHANNEL, timeout_ms)
        torch.cuda.current_stream(device).synchronize()

    def _local(self, offset: int, num_tokens: int) -> torch.Tensor:
        return self._rows(self._buffer, offset, num_tokens)

    def _remote(self, offset: int, num_tokens: int) -> torch.Tensor:
        return self._rows(self._peer_buffer, offset, num_tokens)

    def _rows(self, buffer: torch.Tensor, offset: int, num_tokens: int) -> torch.Tensor:
        self.layout.check_tokens(num_tokens)
        hidden_size = self.layout.hidden_size
        return buffer[offset : offset + num_tokens * hidden_size].view(num_tokens, hidden_size)

    def _put(self, channel: int) -> None:
        self._handle.put_signal(self.peer, channel, self.timeout_ms)

    def _wait(self, channel: int) -> None:
        self._handle.wait_signal(self.peer, channel, self.timeout_ms)

    def _copy(self, target: torch.Tensor, src: torch.Tensor) -> None:
        if src.shape != target.shape or src.dtype != self.dtype:
            raise ValueError(
                f"expected {tuple(target.shape)} {self.dtype}, got {tuple(src.shape)} {src.dtype}"
            )
        target.copy_(src)


class AttentionNVLink(_SymmetricPair):
    """Attention side of the pair (arguments, errors: `_SymmetricPair`).

    Per layer and ubatch: `send_a2f` (or write `a2f_target`, then `commit_a2f`), then
    `recv_f2a`.
    """

    def a2f_target(self, num_tokens: int, ubatch: int = 0) -> torch.Tensor:
        """`[num_tokens, H]` view of the FFN rank's A2F region of `ubatch` (peer memory):
        a kernel may write the A2F tensor straight into it; then call `commit_a2f`."""
        return self._remote(self.layout.a2f_offset(ubatch), num_tokens)

    def commit_a2f(self, ubatch: int = 0) -> None:
        """Raise the A2F flag of `ubatch` once the writes queued before it are done."""
        self._put(self.layout.a2f_channel(ubatch))

    def send_a2f(self, hidden: torch.Tensor, ubatch: int = 0) -> None:
        """Copy `hidden` `[T, H]` (model dtype) into the FFN rank's A2F region of
        `ubatch`, then raise its flag.

        Raises:
            ValueError: `T` outside `[1, max_tokens]`, another width or dtype.
        """
        self._copy(self.a2f_target(hidden.shape[0], ubatch), hidden)
        self.commit_a2f(ubatch)

    def recv_f2a(self, num_tokens: int, ubatch: int = 0) -> torch.Tensor:
        """Make the current stream wait for the F2A flag of `ubatch`; return the
        `[num_tokens, H]` F2A rows in this rank's buffer, valid until the next
        `send_a2f` of `ubatch` (after it the FFN may overwrite them)."""
        self._wait(self.layout.f2a_channel(ubatch))
        return self._local(self.layout.f2a_offset(ubatch), num_tokens)


class FFNNVLink(_SymmetricPair):
    """FFN side of the pair (arguments, errors: `_SymmetricPair`).

    Per layer and ubatch: `recv_a2f`, the FFN layer, then `send_f2a` (or write
    `f2a_target`, then `commit_f2a`).
    """

    def recv_a2f(self, num_tokens: int, ubatch: int = 0) -> torch.Tensor:
        """Make the current stream wait for the A2F flag of `ubatch`; return the
        `[num_tokens, H]` A2F rows in this rank's buffer, valid until the next
        `send_f2a` of `ubatch` (after it the attention may overwrite them)."""
        self._wait(self.layout.a2f_channel(ubatch))
        return self._local(self.layout.a2f_offset(ubatch), num_tokens)

    def f2a_target(self, num_tokens: int, ubatch: int = 0) -> torch.Tensor:
        """`[num_tokens, H]` view of the attention rank's F2A region of `ubatch` (peer
        memory): the FFN's last kernel may write into it; then call `commit_f2a`."""
        return self._remote(self.layout.f2a_offset(ubatch), num_tokens)

    def commit_f2a(self, ubatch: int = 0) -> None:
        """Raise the F2A flag of `ubatch` once the writes queued before it are done."""
        self._put(self.layout.f2a_channel(ubatch))

    def send_f2a(self, out: torch.Tensor, ubatch: int = 0) -> None:
        """Copy the FFN output `out` `[T, H]` (model dtype) into the attention rank's
        F2A region of `ubatch`, then raise its flag.

        Raises:
            ValueError: `T` outside `[1, max_tokens]`, another width or dtype.
        """
        self._copy(self.f2a_target(out.shape[0], ubatch), out)
        self.commit_f2a(ubatch)
