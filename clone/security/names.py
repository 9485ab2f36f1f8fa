"""Client names: the stem of a public certificate file, and the one name reserved.

A client's name is what the ZAP handler puts in a connection's User-Id and what
the ACL's ``[client.NAME]`` tables are keyed by, so the same rule decides which
names ``clone keygen`` may create and which certificates the clients directory
may hold.

Pure: no I/O, no zmq.
"""

from __future__ import annotations

__all__ = ["PEER_USER", "name_problem"]

#: The User-Id of the server pair's own certificate (Binary Star link, the
#: passive's sync).  It contains ``/``, so no certificate file stem can ever be
#: equal to it; it is refused as a client name all the same, so that the rule
#: does not depend on that detail.
PEER_USER = "clone/peer"

_FORBIDDEN_CHARS = ("/", "\\", "\x00")


def name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a client, or ``None`` if it can.

    A name must be a plain file stem: not empty, no path separator, not hidden
    (a leading ``.`` would hide the certificate from ``ls`` and from editors'
    file pickers, which is where a reviewer looks for who has access), and not
    the reserved :data:`PEER_USER`.
    """
    if not name:
        return "a client name must not be empty"
    if name == PEER_USER:
        return f"{name!r} is reserved for the server pair's own certificate"
    for char in _FORBIDDEN_CHARS:
        if char in name:
            return f"a client name is a plain file stem, without {char!r}: {name!r}"
    if name.startswith("."):
        return f"a client name must not start with '.': {name!r}"
    if name.strip() != name:
        return f"a client name must not start or end with whitespace: {name!r}"
    return None
