"""Descriptors: raise the limit at start, and keep a reserve the HTTP port cannot take.

Why: every CHP client costs the server descriptors (a TCP connection on each
of its three ports), and so does every HTTP connection.  An HTTP port with no
cap let 1,567 idle, half-sent requests use up a 1,500-descriptor limit; new CHP
clients then failed to sync.  So at start the soft ``RLIMIT_NOFILE`` is raised to
the hard one (:func:`raise_nofile`), and the HTTP port's connections are capped
at a quarter of that limit, at most 1024 (:func:`http_connection_cap`): the other
three quarters stay for ZeroMQ (CHP clients, the peer, SQLite, the logs).
"""

from __future__ import annotations

import logging
import resource

__all__ = ["HTTP_CAP_MAX", "HTTP_CAP_MIN", "http_connection_cap", "raise_nofile"]

log = logging.getLogger(__name__)

#: The derived cap never goes below this (a small limit still serves a scrape and a page) ...
HTTP_CAP_MIN = 16
#: ... nor above this: more HTTP connections than a monitoring port needs is an attack.
HTTP_CAP_MAX = 1024


def http_connection_cap(nofile: int) -> int:
    """The default cap on the HTTP port's connections for a descriptor limit of ``nofile``."""
    return max(HTTP_CAP_MIN, min(HTTP_CAP_MAX, nofile // 4))


def raise_nofile() -> int:
    """Raise the soft descriptor limit to the hard one; return the limit now in force."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return 1024
    if hard == resource.RLIM_INFINITY or soft == hard:
        return soft if soft != resource.RLIM_INFINITY else 1 << 20
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError) as exc:
        log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, hard, exc)
        return soft
    log.info("raised the descriptor limit from %d to %d", soft, hard)
    return hard
