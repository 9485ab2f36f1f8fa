"""What the client agent does with each command of its frontend (sans-IO).

The agent (:mod:`clone.client.agent`) reads a command from the pipe
(:mod:`clone.client.verbs`), hands its verb and arguments here and sends back
what :meth:`Commands.answer` returns (or an ERROR for the ``ValueError``,
``TypeError``, ``IndexError`` or :class:`~clone.errors.ProtocolError` it
raises).  One handler per verb, from a table; an unknown verb is an error.
No socket and no clock of its own: the state machine, a clock and three
callbacks of the agent's (carry out actions, add a server, stop the loop).
"""

from __future__ import annotations

import json
import marshal
from collections.abc import Callable

from clone.client.fsm import Action, AgentFSM
from clone.client.listings import Listings
from clone.client.verbs import (
    CALL,
    CONNECT,
    GET,
    ITEMS,
    LEASE,
    LIST,
    PAGE,
    SET,
    STATUS,
    TERMINATE,
    UNLIST,
    WATCH,
)
from clone.wire.calls import decode_call
from clone.wire.codec import decode_kvset, encode_kv

__all__ = ["Commands", "status"]

_Args = list[bytes]


def status(fsm: AgentFSM) -> dict[str, object]:
    """The STATUS answer: the agent's state as JSON-ready values."""
    current = None if fsm.current is None else fsm.servers[fsm.current]
    return {
        "state": fsm.state.value,
        "server": current,
        "servers": list(fsm.servers),
        "subtrees": list(fsm.subtrees),
        "sequence": fsm.last_sequence,
        "keys": len(fsm),
        "pending_writes": fsm.pending_writes,
        "pending_calls": fsm.pending_calls,
        "leases": len(fsm.kept_leases),
        "counters": {
            **fsm.counters.as_dict(),
            # A gauge: the silence that would make us fail over now.
            "silence_timeout_ms": round(1000 * fsm.silence_timeout()),
        },
    }


class Commands:
    """The frontend's commands, answered on the agent's thread."""

    def __init__(
        self,
        fsm: AgentFSM,
        clock: Callable[[], float],
        execute: Callable[[list[Action]], None],
        add_server: Callable[[str], None],
        stop: Callable[[], None],
    ) -> None:
        self._fsm = fsm
        self._clock = clock
        self._execute = execute
        self._add_server = add_server
        self._stop = stop
        self._listings = Listings()
        self._table: dict[bytes, Callable[[_Args], list[bytes]]] = {
            GET: self._get,
            SET: self._set,
            CALL: self._call,
            LEASE: self._lease,
            ITEMS: self._items,
            LIST: self._list,
            PAGE: self._page,
            UNLIST: self._unlist,
            STATUS: self._status,
            WATCH: self._watch,
            CONNECT: self._connect,
            TERMINATE: self._terminate,
        }

    def answer(self, verb: bytes, args: _Args) -> list[bytes]:
        """The reply frames (after the ``OK rid``) of one command."""
        handler = self._table.get(verb)
        if handler is None:
            raise ValueError(f"unknown command {verb[:32]!r}")
        return handler(args)

    def _get(self, args: _Args) -> list[bytes]:
        entry = self._fsm.get(args[0].decode("utf-8"))
        return [] if entry is None else encode_kv(entry)

    def _set(self, args: _Args) -> list[bytes]:
        confirm = float(args[0]) if args[0] else None
        # Decoded to check it and for the FSM's bookkeeping; its frames are
        # sent as the frontend built them, not encoded again.
        frames = args[1:]
        msg = decode_kvset(frames)
        fsm = self._fsm
        if confirm is None:
            self._execute(fsm.write_unconfirmed(msg, self._clock(), frames=frames))
        else:
            self._execute(fsm.write_confirmed(msg, self._clock(), within=confirm, frames=frames))
        return []

    def _call(self, args: _Args) -> list[bytes]:
        call = decode_call(args[1:])
        self._execute(self._fsm.call(call, self._clock(), within=float(args[0])))
        return []

    def _lease(self, args: _Args) -> list[bytes]:
        secret = args[2].decode("ascii") if len(args) > 2 else ""
        lease_id, ttl = args[0].decode("ascii"), float(args[1])
        self._execute(self._fsm.keep_lease(lease_id, ttl, self._clock(), secret))
        return []

    def _items(self, args: _Args) -> list[bytes]:
        # Version 2: no back-references, which only cost time here.
        return [marshal.dumps(self._fsm.rows(args[0].decode("utf-8")), 2)]

    def _list(self, args: _Args) -> list[bytes]:
        # References to the replica's rows, sorted: each page is packed when asked.
        return [str(self._listings.open(self._fsm.rows(args[0].decode("utf-8")))).encode()]

    def _page(self, args: _Args) -> list[bytes]:
        rows, more = self._listings.page(int(args[0]), int(args[1]))
        return [b"1" if more else b"0", marshal.dumps(rows, 2)]

    def _unlist(self, args: _Args) -> list[bytes]:
        self._listings.close(int(args[0]))
        return []

    def _status(self, args: _Args) -> list[bytes]:
        return [json.dumps(status(self._fsm)).encode()]

    def _watch(self, args: _Args) -> list[bytes]:
        self._fsm.emit_changes = args[0] == b"1"
        return []

    def _connect(self, args: _Args) -> list[bytes]:
        self._add_server(args[0].decode("utf-8"))
        return []

    def _terminate(self, args: _Args) -> list[bytes]:
        self._stop()
        fsm = self._fsm
        # What stopping drops, for close() to say.
        dropped = {"unsent": fsm.held_writes, "unconfirmed": fsm.pending_writes}
        return [json.dumps(dropped).encode()]
