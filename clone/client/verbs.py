"""The pipe protocol between a client's frontend and its agent thread (pure).

Two inproc PAIR pipes join :class:`~clone.client.frontend.Clone` to its
:class:`~clone.client.agent.Agent`: commands on one (:mod:`clone.client.pipe`),
events on the other (:mod:`clone.client.events`).  Both ends speak the verbs
below; this module is the one place they are spelled.

The pipe protocol, all frames bytes:

* frontend -> agent, one reply each, ``rid`` echoed:
  ``CONNECT rid endpoint``, ``SET rid confirm_seconds|'' key seq uuid props body``,
  ``GET rid key``, ``ITEMS rid prefix``, ``STATUS rid``, ``WATCH rid 1|0``,
  ``CALL rid within_seconds call-frames...`` (the six frames of a CALL?),
  ``LEASE rid lease_id ttl [secret]`` (keep it alive), ``TERMINATE rid``;
  a listing read page by page (:mod:`clone.client.listings`): ``LIST rid
  prefix`` (its reply: the listing's id), ``PAGE rid id limit`` (``1|0`` for
  whether more follow, then the rows as ITEMS gives them), ``UNLIST rid id``.  Replies are
  ``OK rid ...`` or ``ERROR rid text``; an unknown command gets an ERROR too.  A
  SET or CALL with an empty ``rid`` is one-way: no reply, so writes stream
  without a round trip each; if it fails, the agent says so with ``FAILED uuid
  text`` on the event pipe.  The ITEMS reply is one frame, a
  :mod:`marshal` dump of ``[(key, (sequence, uuid, properties, body)), ...]``:
  five frames per entry made a 1M-key reply 5M frames, longer to send and split
  than the command timeout; the frame never leaves the process (inproc), so
  marshal's lack of checks against hostile input does not matter.
* agent -> frontend, on the separate event pipe: ``STARTED``, ``CONFIRMED uuid
  seq`` (8 bytes, the sequence the server gave the write), ``FAILED uuid text``,
  ``REFUSED uuid reason key`` (the server refused a confirmed write), ``REPLY
  uuid reply-frames...`` (the four frames of a call's REPLY), ``LEASELOST
  lease_id why`` (a kept lease is gone), ``STATE state endpoint``, ``CHANGE key
  seq uuid props body [RESYNC]`` (empty body: deleted; the ``RESYNC`` frame
  when the change comes from a resync's diff), ``STOPPED``.
"""

from __future__ import annotations

__all__ = [
    "CALL",
    "CHANGE",
    "CONFIRMED",
    "CONFLICT",
    "CONNECT",
    "ERROR",
    "FAILED",
    "GET",
    "ITEMS",
    "LEASE",
    "LEASEKEPT",
    "LEASELOST",
    "LIST",
    "OK",
    "PAGE",
    "REFUSED",
    "REPLY",
    "RESYNC_MARK",
    "SET",
    "STARTED",
    "STATE",
    "STATUS",
    "STOPPED",
    "TERMINATE",
    "UNLIST",
    "WATCH",
]

# Pipe commands and replies.
CONNECT, SET, GET, ITEMS, STATUS, WATCH, CALL, LEASE, TERMINATE = (
    b"CONNECT",
    b"SET",
    b"GET",
    b"ITEMS",
    b"STATUS",
    b"WATCH",
    b"CALL",
    b"LEASE",
    b"TERMINATE",
)
#: A listing read page by page: open it, read a page, drop it.
LIST, PAGE, UNLIST = b"LIST", b"PAGE", b"UNLIST"
OK, ERROR = b"OK", b"ERROR"
STARTED, CONFIRMED, FAILED, REFUSED, REPLY, LEASELOST, STATE, CHANGE, STOPPED = (
    b"STARTED",
    b"CONFIRMED",
    b"FAILED",
    b"REFUSED",
    b"REPLY",
    b"LEASELOST",
    b"STATE",
    b"CHANGE",
    b"STOPPED",
)
#: A keepalive was answered: ``LEASEKEPT id valid_until`` (monotonic seconds, repr).
LEASEKEPT = b"LEASEKEPT"
#: A confirmed write became a split-brain conflict: ``CONFLICT uuid key``.
CONFLICT = b"CONFLICT"
#: The last frame of a CHANGE learned from a resync, not from an update.
RESYNC_MARK = b"RESYNC"
