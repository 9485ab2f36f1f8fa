"""Who owns a lease, and who may use it (docs/protocol.md, "Lease ownership").

How this works: every call reaches the active server with a *principal*, the
caller as the server knows it: ``name:<certificate name>`` when CURVE
authenticated it (or a relay the pair trusts, ``--trusted-relay``, said so in
``caller=``), else ``addr:<peer address>`` (nothing authenticated it), or ""
when nothing is known.  A lease granted to a ``name:`` principal is owned by
that name; any other grant is owned by whoever knows its *secret*: 32 hex
digits the caller sends (or the server picks and hands back), of which only
the SHA-256 is kept, in the lease key's ``owner=`` property.  The lease id is
public (every key bound to it shows ``lease=<id>``); the secret never is.

A keepalive, a revoke or a ``set`` with ``lease=`` is allowed only to the
owner: the same name, or a caller that sends the secret.  A lease with no
owner recorded (its key was written before ownership existed) is allowed to
nobody: fail closed.  The pair's own certificate (the peer forwarding a split
brain's writes) may use any lease.

The per-client quota counts leases per principal; without CURVE that is the
peer address the server sees (a relay's clients count as the relay).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable

from clone.security.names import PEER_USER

__all__ = [
    "PEER_PRINCIPAL",
    "grant_owner",
    "may_use",
    "name_principal",
    "new_secret",
    "secret_owner",
]

_NAME = "name:"
_SECRET = "secret:"
#: The principal of the pair's own certificate.
PEER_PRINCIPAL = _NAME + PEER_USER


def name_principal(name: str) -> str:
    """The principal of a caller CURVE authenticated as ``name``."""
    return _NAME + name


def new_secret() -> str:
    """A fresh lease secret: 128 random bits as 32 lowercase hex digits."""
    return secrets.token_hex(16)


def secret_owner(secret: str) -> str:
    """The owner recorded for a lease whose proof is ``secret`` (its hash)."""
    return _SECRET + hashlib.sha256(secret.encode("ascii")).hexdigest()


def grant_owner(
    principal: str, secret: str | None, make_secret: Callable[[], str] = new_secret
) -> tuple[str, str]:
    """The owner of a lease granted to ``principal``, and the secret to hand
    back ("" when the owner is a name: the name is the proof)."""
    if principal.startswith(_NAME):
        return principal, ""
    if secret is None:
        secret = make_secret()
    return secret_owner(secret), secret


def may_use(owner: str | None, principal: str, secret: str | None) -> bool:
    """Whether a caller may keep alive, revoke or bind to a lease owned by ``owner``."""
    if principal == PEER_PRINCIPAL:
        return True
    if owner is None:
        return False  # from before ownership: nobody
    if owner.startswith(_NAME):
        return owner == principal
    return secret is not None and secret_owner(secret) == owner
