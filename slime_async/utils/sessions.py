"""Who holds a producer or consumer id: one live session per id.

A session is the random id a client object sends with its requests; a connection is the file
descriptor of the TCP (or ipc) connection a message came over (ZeroMQ's SRCFD; a client that
reconnects gets a new one). An id belongs to the session that used it last while that session's
connection is up: another session asking for it is refused, so two generators under one producer
id (or a second learner under the learner's id) never share a sequence ledger or a batch. The
socket monitor reports each disconnection (ZeroMQ heartbeats close silent connections), which
frees the id: a restarted process (a new session) takes it over at once.

Memory: one entry per id, at most `limit`, at most `per_connection` held by one connection (so
one connection cannot fill the table); entries whose connection is gone are forgotten after
`idle_s` by `expire`, at once by `forget` (the buffer forgets ids that stored nothing when their
connection closes), or, the table being full, the longest-silent one first (`evict`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field


class IdInUse(Exception):
    """The id is held by another live session (the message says which id and since when)."""


class TooManyIds(Exception):
    """The table is full of live ids (the message names the limit)."""


@dataclass
class Holder:
    session: str
    connection: int | None
    """The file descriptor of the holder's connection; None once it disconnected."""
    last_heard: float = field(default_factory=time.monotonic)


class Owners:
    """The id -> holding session table of one kind of client ("producer", "consumer")."""

    def __init__(self, kind: str, limit: int, idle_s: float, per_connection: int | None = None):
        self.kind = kind
        self.limit = limit
        self.idle_s = idle_s
        self.per_connection = per_connection if per_connection is not None else limit
        self.holders: dict[str, Holder] = {}
        self._by_connection: dict[int, set[str]] = {}

    def __len__(self) -> int:
        return len(self.holders)

    def __iter__(self) -> Iterator[Holder]:
        return iter(self.holders.values())

    def live(self, name: str) -> bool:
        h = self.holders.get(name)
        return h is not None and h.connection is not None

    def claim(self, name: str, session: str, connection: int) -> bool:
        """`session`, over `connection`, uses `name`; True when it took the id over from another
        session (or a fresh start). IdInUse when another session holds it and is connected."""
        h = self.holders.get(name)
        now = time.monotonic()
        if h is not None and h.session == session:
            if h.connection != connection:
                self._unlink(name, h.connection)
                self._link(name, connection)
                h.connection = connection
            h.last_heard = now
            return False
        if h is not None and h.connection is not None:
            raise IdInUse(
                f"{self.kind}: id {name!r} is held by another live session (last heard "
                f"{now - h.last_heard:.1f}s ago); two clients must not share one {self.kind} id "
                "(stop the other one, or give this one its own id)"
            )
        held = self._by_connection.get(connection, ())
        if len(held) >= self.per_connection and name not in held:
            raise TooManyIds(
                f"{self.kind}: this connection holds {len(held)} {self.kind} ids, the limit "
                f"(buffer.max_ids_per_connection) is {self.per_connection}"
            )
        if h is None and len(self.holders) >= self.limit:
            raise TooManyIds(
                f"{self.kind}: {len(self.holders)} {self.kind} ids are known, the limit "
                f"(buffer.max_{self.kind}s) is {self.limit}"
            )
        if h is not None:
            self._unlink(name, h.connection)
        self.holders[name] = Holder(session, connection, now)
        self._link(name, connection)
        return True

    def disconnected(self, connection: int) -> list[str]:
        """`connection` closed: the ids it held are free now; return them."""
        names = self._by_connection.pop(connection, set())
        for name in names:
            h = self.holders.get(name)
            if h is not None and h.connection == connection:
                h.connection = None
        return sorted(names)

    def forget(self, name: str) -> None:
        """Drop the entry of `name` if its holder is disconnected."""
        h = self.holders.get(name)
        if h is not None and h.connection is None:
            del self.holders[name]

    def evict(self) -> str | None:
        """Forget the disconnected id silent longest (the table is full); None: all are live."""
        gone = [(h.last_heard, n) for n, h in self.holders.items() if h.connection is None]
        if not gone:
            return None
        name = min(gone)[1]
        del self.holders[name]
        return name

    def expire(self) -> list[str]:
        """Forget ids whose holder is disconnected and silent for `idle_s`; return them."""
        horizon = time.monotonic() - self.idle_s
        gone = [
            n for n, h in self.holders.items() if h.connection is None and h.last_heard < horizon
        ]
        for n in gone:
            del self.holders[n]
        return gone

    def _link(self, name: str, connection: int | None) -> None:
        if connection is not None:
            self._by_connection.setdefault(connection, set()).add(name)

    def _unlink(self, name: str, connection: int | None) -> None:
        if connection is not None:
            names = self._by_connection.get(connection)
            if names is not None:
                names.discard(name)
                if not names:
                    del self._by_connection[connection]
