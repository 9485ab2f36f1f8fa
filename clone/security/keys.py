"""A client's CURVE keys: where they come from and how they are loaded.

The frontend, the pipeline's writers and the ``clone`` command all take the
same two files (this client's secret certificate, the server pair's public
one), from arguments or ``$CLONE_CURVE_SECRET`` / ``$CLONE_SERVER_KEY``.  They
are read once, by the caller's thread, so that a bad file is an error at
construction and not a handshake that silently never completes.
"""

from __future__ import annotations

import os

from clone.security.certs import KeyPair, load_public, load_secret

__all__ = ["default_curve_files", "load_curve_keys"]


def default_curve_files() -> tuple[str | None, str | None]:
    """``($CLONE_CURVE_SECRET, $CLONE_SERVER_KEY)``, each None if unset or empty.

    Set both for CURVE (our secret certificate, the server's public one), or
    neither; one alone is refused by :func:`load_curve_keys`, as the arguments are.
    """
    secret = os.environ.get("CLONE_CURVE_SECRET", "").strip() or None
    server = os.environ.get("CLONE_SERVER_KEY", "").strip() or None
    return secret, server


def load_curve_keys(
    curve_secret: str | os.PathLike[str] | None,
    server_key: str | os.PathLike[str] | None,
) -> tuple[KeyPair, bytes] | None:
    """Our key pair and the server's public key, or None for a plain
    connection; ValueError for one file without the other,
    :class:`~clone.errors.SecurityError` for a missing or bad file."""
    if curve_secret is None and server_key is None:
        return None
    if curve_secret is None or server_key is None:
        given, missing = (
            ("curve_secret", "server_key") if server_key is None else ("server_key", "curve_secret")
        )
        raise ValueError(
            f"{given} was given without {missing}: CURVE needs both this client's secret "
            f"certificate (curve_secret, $CLONE_CURVE_SECRET) and the server's public "
            f"certificate (server_key, $CLONE_SERVER_KEY); pass both, or neither for a "
            f"plain connection"
        )
    return load_secret(curve_secret), load_public(server_key)
