"""Who may write what: the ACL's decisions on a write and on a call, pure.

Why a module of its own: the collector (a KVSET from a CURVE connection)
and a relay (a CALL? it forwards upstream) ask the same questions of the
same settings.  Here they are plain functions of a name and the rights the
server holds, tested without sockets (tests/server/test_access.py); the
I/O parts count, log and tell the writer.

:class:`Access` is the settings themselves, one small object the security
part installs (at start and on SIGHUP) and the other parts only read: the
caller, the collector, the relay link and the snapshot port each get it,
instead of reading the rights from attributes on the server.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from clone.errors import ProtocolError
from clone.security import NOTHING, PEER_USER, Rights
from clone.wire.calls import acl_refusal, check_call, decode_call

__all__ = ["NOT_ADMITTED", "Access", "call_refusal", "may_write"]

#: Why a call from a name the clients directory no longer holds is refused.
NOT_ADMITTED = "this client is no longer admitted"


def may_write(
    user: str | None,
    frames: list[bytes],
    *,
    write_all: Collection[str | None],
    admitted: Collection[str | None],
    rights_of: Callable[[str | None], Rights],
) -> bool:
    """Whether ``user`` may write the key of a KVSET (``frames[0]``).

    Writers of everything (the peer, names with a write-all grant) may;
    anyone else must still be admitted and hold a write prefix of the key.
    """
    return user in write_all or (
        user in admitted and bool(frames) and rights_of(user).can_write(frames[0])
    )


def call_refusal(
    frames: list[bytes],
    user: str | None,
    *,
    write_all: Collection[str | None],
    admitted: Collection[str | None],
    rights_of: Callable[[str | None], Rights],
) -> str | None:
    """Why the ACL refuses this call to ``user``, or None to let it through.

    A call that decodes but asks for something malformed is let through as
    it is: the active server says precisely what is wrong with it.  A call
    that does not decode at all, from a restricted writer, is refused: it may
    be an operation newer than this relay (``set-many`` was one), whose keys
    the relay cannot judge, and the pair would judge it by the relay's own,
    wider rights.  (A relay from before this rule lets such a call through:
    upgrade relays before the pair, docs/protocol.md.)  The rule is the
    active server's (:func:`~clone.wire.calls.acl_refusal`): a grant that
    names a key outside the caller's write prefixes is refused.
    """
    if user == PEER_USER or user in write_all:
        return None
    if user is None or user not in admitted:
        return NOT_ADMITTED
    rights = rights_of(user)
    try:
        call = decode_call(frames)
    except ProtocolError as exc:
        return f"a call this relay cannot read is not forwarded for a restricted writer ({exc})"
    if check_call(call) is not None:
        return None
    return acl_refusal(call, rights.can_write, bool(rights.write))


class Access:
    """Who is admitted and what each name may do, as one server holds it.

    Without ``--curve-secret`` it stays empty and ``secure`` is False: nobody
    can be told from anybody, and the parts let every write through (the
    check is theirs to skip).  Fail closed: an unknown or removed name has
    :data:`~clone.security.NOTHING`.
    """

    __slots__ = ("_rights", "admitted", "secure", "write_all")

    def __init__(self) -> None:
        self.secure = False
        self.admitted: set[str] = set()  # names whose connections count
        self.write_all: set[str] = set()  # names whose write prefixes include b""
        self._rights: dict[str, Rights] = {}

    def install(self, rights: dict[str, Rights]) -> None:
        """Replace the admitted names and their rights (the peer's included)."""
        self.admitted = set(rights)
        self._rights = dict(rights)
        # Who may write every key: their writes skip the prefix check (hot path).
        self.write_all = {name for name, r in rights.items() if b"" in r.write}

    def rights_of(self, name: str | None) -> Rights:
        """A connection's rights: nothing for an unknown or removed name."""
        if name is None:
            return NOTHING
        return self._rights.get(name, NOTHING)

    def may_write(self, user: str | None, frames: list[bytes]) -> bool:
        """:func:`may_write` under these settings."""
        return may_write(
            user,
            frames,
            write_all=self.write_all,
            admitted=self.admitted,
            rights_of=self.rights_of,
        )

    def call_refusal(self, frames: list[bytes], user: str | None) -> str | None:
        """:func:`call_refusal` under these settings."""
        return call_refusal(
            frames,
            user,
            write_all=self.write_all,
            admitted=self.admitted,
            rights_of=self.rights_of,
        )
