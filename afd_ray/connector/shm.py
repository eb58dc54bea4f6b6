"""`shm`: the data plane of a pair whose two processes share one host (CPU tensors).

Memory: one anonymous shared-memory file (`memfd`) per pair, created by the attention
side and passed to the FFN side over a Unix socket (`SCM_RIGHTS`), so no name exists
in `/dev/shm` and the kernel frees it when both sides are gone. It holds, per
micro-batch `u`, two slots of `slot_bytes` each:

    [ A2F slot u=0 | F2A slot u=0 | A2F slot u=1 | F2A slot u=1 | ... ]

The sender copies its tensors (concatenated as bytes) into its direction's slot and
the receiver copies them out into its `out` buffers: one memcpy per side, no kernel
copy of the payload.

Wake-up: one connected Unix stream socket per micro-batch. A message is one byte
(`M`) sent after the slot was written; the receiver blocks in `recv` on it (the
kernel wakes it, no spinning and no TCP). A message larger than a slot goes in
slot-sized chunks, each but the last acknowledged by one byte (`A`) back. Because a
side sends on a ubatch only after it received the other direction's previous message
(the contract's alternation, `afd_ray.connector.link`), one byte stream per ubatch
carries both directions unambiguously, and a slot is never overwritten before it was
read. The socket write/read pair also orders the slot's memory between the two
processes (both are syscalls).

Failure: the socket is the pair's liveness. A peer that dies or closes closes its
end, so a blocked `recv` returns at once (`PeerLostError`); every wait is bounded by
`timeout_s` (socket timeout); `close()` shuts the socket down, which wakes a wait in
another thread at once, and every wait or send on a closed side fails at once
(`PeerLostError` "pair closed").
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from afd_ray.connector.link import PeerLostError, contiguous
from afd_ray.connector.pair import Done, Side

__all__ = ["SLOT_BYTES", "ShmPair", "open_shm_pair"]

SLOT_BYTES = 8 << 20
"""Bytes of one slot (one direction of one ubatch): `[T, H]` float32 rows up to
T*H*4 <= 8 MiB go in one message (T = 3640 at H = 576), larger ones in chunks. The
file's pages are allocated only when touched."""
_MSG = b"M"
_ACK = b"A"
_SOCKET_KEY = "shm/socket"


class _Receive:
    """A receive posted on a ubatch; runs when waited on (once)."""

    def __init__(self, pair: ShmPair, outs: Sequence[torch.Tensor], ubatch: int) -> None:
        self._pair, self._outs, self._ubatch = pair, outs, ubatch
        self._done = False

    def wait(self) -> None:
        if not self._done:
            self._done = True
            self._pair.recv_now(self._outs, self._ubatch)


class ShmPair:
    """One side of a pair's shared-memory data plane, a `Pair` (built by `open_shm_pair`).

    Args:
        side: `attention` (sends A2F, receives F2A) or `ffn` (the reverse).
        socks: one connected Unix stream socket per ubatch.
        region: the shared file mapped as `[ubatches * 2 * slot_bytes]` uint8.
        slot_bytes: bytes of one slot.
        peer: attention rank id of the pair (for errors).
        timeout_s: bound on every wait, seconds.
    """

    def __init__(
        self,
        side: Side,
        socks: list[socket.socket],
        region: torch.Tensor,
        slot_bytes: int,
        peer: int,
        timeout_s: float,
    ) -> None:
        self._socks = socks
        self._peer = peer
        slots = region.view(len(socks), 2, slot_bytes)  # [U, direction (A2F, F2A), bytes]
        send, recv = (0, 1) if side == "attention" else (1, 0)
        self._send = [slots[u, send] for u in range(len(socks))]
        self._recv = [slots[u, recv] for u in range(len(socks))]
        for sock in socks:
            sock.settimeout(timeout_s)
        self._timeout_s = timeout_s
        self._closed = False

    def send(self, tensors: Sequence[torch.Tensor], ubatch: int) -> Done:
        """Copy `tensors` (contiguous, any dtype) into this side's slot of `ubatch`
        and wake the peer; done on return (chunks wait for the peer's acks).

        Raises:
            PeerLostError: the peer is gone, or this side was closed ("pair closed").
        """
        contiguous(tensors)
        sock, slot = self._socks[ubatch], self._slot(self._send, ubatch)
        for data, room in _pieces(tensors, slot, lambda: self._hand_over(sock, _MSG, _ACK)):
            room.copy_(data)
        self._signal(sock, _MSG)
        return Done()

    def recv(self, outs: Sequence[torch.Tensor], ubatch: int) -> _Receive:
        """A receive of `ubatch`'s next message into `outs` (contiguous, the shapes
        and dtypes the sender used), done when waited on."""
        contiguous(outs)
        return _Receive(self, outs, ubatch)

    def recv_now(self, outs: Sequence[torch.Tensor], ubatch: int) -> None:
        """Block until `ubatch`'s next message arrived and copy it into `outs`.

        Raises:
            PeerLostError: the peer is gone, no message came within `timeout_s`, or
                this side was closed ("pair closed"), before or during the wait.
        """
        sock, slot = self._socks[ubatch], self._slot(self._recv, ubatch)
        self._expect(sock, _MSG)
        for data, room in _pieces(outs, slot, lambda: self._hand_over(sock, _ACK, _MSG)):
            data.copy_(room)

    def exchange(self, sends: Sequence[torch.Tensor], outs: Sequence[torch.Tensor], ubatch: int) -> None:
        """`send(sends)` then receive the answer into `outs` (attention side)."""
        self.send(sends, ubatch)
        self.recv_now(outs, ubatch)

    def _slot(self, slots: list[torch.Tensor], ubatch: int) -> torch.Tensor:
        """`slots[ubatch]`, a view that keeps the mapping alive through a `close()`
        from another thread (which drops this side's lists of slots)."""
        if self._closed:
            raise self._closed_error()
        return slots[ubatch]

    def _closed_error(self) -> PeerLostError:
        return PeerLostError(self._peer, "pair closed")

    def _hand_over(self, sock: socket.socket, sent: bytes, expected: bytes) -> None:
        """The slot is full: send `sent` (`M`: a chunk is ready; `A`: it was read),
        then wait for the peer's `expected` answer."""
        self._signal(sock, sent)
        self._expect(sock, expected)

    def _signal(self, sock: socket.socket, byte: bytes) -> None:
        try:
            sock.sendall(byte)
        except OSError as exc:
            if self._closed:  # shut down or closed by `close()`, before or during the call
                raise self._closed_error() from exc
            raise PeerLostError(self._peer, f"shm wake-up not sent ({exc})") from exc

    def _expect(self, sock: socket.socket, byte: bytes) -> None:
        try:
            got = sock.recv(1)
        except TimeoutError as exc:
            raise PeerLostError(self._peer, f"no shm message within {self._timeout_s} s") from exc
        except OSError as exc:
            if self._closed:  # closed by `close()` before the call: EBADF
                raise self._closed_error() from exc
            raise PeerLostError(self._peer, f"shm socket failed ({exc})") from exc
        if not got:
            if self._closed:  # `close()` shut the socket down during the wait
                raise self._closed_error()
            raise PeerLostError(self._peer, "peer closed the pair or died")
        if got != byte:
            raise PeerLostError(self._peer, f"shm protocol broken: got {got!r}, expected {byte!r}")

    def close(self) -> None:
        """Shut the sockets down and drop this side's mapping. Idempotent. A wait in
        another thread fails at once, and every send or wait afterwards (a receive
        posted before included) fails the same way: `PeerLostError` "pair closed"."""
        self._closed = True
        for sock in self._socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # the peer closed first: already shut
            sock.close()
        self._send, self._recv = [], []


def _pieces(
    tensors: Sequence[torch.Tensor], slot: torch.Tensor, slot_full: Callable[[], None]
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The bytes of `tensors` (contiguous), in order, paired with the bytes of `slot`
    `[slot_bytes]` uint8 they travel through: `(data, room)` views of equal length,
    `data` aliasing a tensor. The slot is filled from its start; when it is full and
    bytes are left, `slot_full()` runs (the chunk hand-over) before the next piece,
    which starts the slot again. The caller copies each piece (send: `room <- data`;
    receive: `data <- room`) before asking for the next."""
    offset = 0
    for tensor in tensors:
        data = tensor.reshape(-1).view(torch.uint8)  # [nbytes], aliases tensor
        pos = 0
        while pos < data.numel():
            if offset == slot.numel():
                slot_full()
                offset = 0
            n = min(slot.numel() - offset, data.numel() - pos)
            yield data[pos : pos + n], slot[offset : offset + n]
            offset, pos = offset + n, pos + n


def _map(fd: int, nbytes: int) -> torch.Tensor:
    """`[nbytes]` uint8 tensor over the shared file `fd` (the mapping lives as long
    as the tensor; `fd` may be closed afterwards)."""
    return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)


def open_shm_pair(
    side: Side, store: dist.Store, peer: int, ubatches: int, timeout_s: float, slot_bytes: int = SLOT_BYTES
) -> ShmPair:
    """Open one side of a pair's `shm` data plane; blocks until the other side opened
    its side (bounded by `timeout_s`).

    The attention side creates the shared file and listens on an abstract Unix
    socket whose name it publishes in `store` (the pair's prefix store); the FFN side
    reads the name, connects once per ubatch and receives the file over the first
    connection.

    Raises:
        PeerLostError: the other side did not connect within `timeout_s`.
    """
    nbytes = ubatches * 2 * slot_bytes
    try:
        if side == "attention":
            return _open_attention(store, peer, ubatches, timeout_s, slot_bytes, nbytes)
        return _open_ffn(store, peer, ubatches, timeout_s, slot_bytes, nbytes)
    except (OSError, RuntimeError) as exc:
        if isinstance(exc, PeerLostError):
            raise
        raise PeerLostError(peer, f"shm rendezvous failed ({exc})") from exc


def _open_attention(
    store: dist.Store, peer: int, ubatches: int, timeout_s: float, slot_bytes: int, nbytes: int
) -> ShmPair:
    name = f"\0afd_ray/{os.getpid()}/{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(name)
        listener.listen(ubatches)
        listener.settimeout(timeout_s)
        store.set(_SOCKET_KEY, name.encode())
        fd = os.memfd_create(f"afd_ray-pair-{peer}")
        try:
            os.ftruncate(fd, nbytes)
            region = _map(fd, nbytes)
            socks = [listener.accept()[0] for _ in range(ubatches)]
            layout = json.dumps({"slot_bytes": slot_bytes, "ubatches": ubatches}).encode()
            socket.send_fds(socks[0], [layout], [fd])
        finally:
            os.close(fd)
    return ShmPair("attention", socks, region, slot_bytes, peer, timeout_s)


def _open_ffn(store: dist.Store, peer: int, ubatches: int, timeout_s: float, slot_bytes: int, nbytes: int) -> ShmPair:
    store.wait([_SOCKET_KEY])
    name = store.get(_SOCKET_KEY).decode()
    socks = []
    for _ in range(ubatches):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        sock.connect(name)
        socks.append(sock)
    layout, fds, _, _ = socket.recv_fds(socks[0], 1024, 1)
    if len(fds) != 1 or json.loads(layout) != {"slot_bytes": slot_bytes, "ubatches": ubatches}:
        raise PeerLostError(peer, f"shm layout mismatch: {layout!r}")
    try:
        region = _map(fds[0], nbytes)
    finally:
        os.close(fds[0])
    return ShmPair("ffn", socks, region, slot_bytes, peer, timeout_s)
