"""An FFN rank's process ending, seen by the coordinator at once.

The coordinator holds one idle TCP connection to each live FFN rank's `TCPStore` (the
rank's `FFNAddress.store_port`, served by the rank's own process). When that process
ends (SIGKILL, a crash, an exit), its kernel closes the connection and the coordinator
reads EOF within milliseconds, where Serve's replica states tell it only once Serve's
health check of the replica (every 0.5 s for an FFN rank) failed. The store never
writes to a client that sends nothing, and a client that sends nothing disturbs no
rendezvous on it.

What this does not see: a hung or stopped process keeps its connection open (the
heartbeat, `ffn.heartbeat_timeout_s`, finds it), and neither does a lost node's
(Serve's replica states, or the heartbeat). A connection that cannot be opened proves
nothing either: the other detections decide.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from afd_ray.control.membership import FFNMember, MemberState

__all__ = ["CONNECT_S", "ProcessWatch"]

logger = logging.getLogger("ray.serve")

CONNECT_S = 5.0
"""Bound on opening the connection to a rank's store, seconds."""


class ProcessWatch:
    """One connection per live FFN rank; `ended` holds the ranks whose process ended."""

    def __init__(self) -> None:
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self.ended: dict[int, str] = {}
        """FFN ranks whose process ended, and how it was seen."""
        self.changed = asyncio.Event()
        """Set when a rank joins `ended` (the recovery clears it)."""

    def follow(self, members: Mapping[int, FFNMember]) -> None:
        """Watch every FFN rank of `members` that is not GONE and not watched yet; stop
        watching (and forget) the GONE ones."""
        for rank, member in members.items():
            if member.state is MemberState.GONE:
                task = self._tasks.pop(rank, None)
                if task is not None:
                    task.cancel()
                self.ended.pop(rank, None)
            elif rank not in self._tasks:
                self._tasks[rank] = asyncio.create_task(self._watch(rank, member))

    async def _watch(self, rank: int, member: FFNMember) -> None:
        address = member.address
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(address.host, address.store_port), CONNECT_S
            )
        except (OSError, TimeoutError) as exc:
            logger.debug("FFN rank %d: no connection to its store (%s); not watched", rank, exc)
            return
        try:
            while await reader.read(1024):  # the store sends nothing; b"" is EOF
                pass
        except OSError:  # e.g. reset by the ending process
            pass
        finally:
            writer.close()
        self.ended[rank] = f"its process ended (connection to its store at {address.host}:{address.store_port} closed)"
        self.changed.set()
