"""argparse value types and endpoint spelling shared by the command-line entry points.

A bad number gets argparse's usual one-line usage error that names the flag,
instead of a traceback from deep inside the program.  A server endpoint may be
written ``host:port`` or ``tcp://host:port`` wherever a user types one
(:func:`normalize_endpoint`), so the same ``--servers`` value works for
``clone``, ``clone-pipeline`` and ``Clone(...)``.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from clone.wire.protocol import COLLECTOR_OFFSET

__all__ = [
    "non_negative_float",
    "non_negative_int",
    "normalize_endpoint",
    "normalize_endpoints",
    "positive_float",
    "positive_int",
    "split_endpoint",
    "strip_scheme",
]

_SCHEME = "tcp://"


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def strip_scheme(endpoint: str) -> str:
    """``tcp://host:port`` -> ``host:port`` (the servers' own flags: --peer,
    --peer-ha, --upstream); anything else unchanged, for the caller to check."""
    return endpoint[len(_SCHEME) :] if endpoint.startswith(_SCHEME) else endpoint


def normalize_endpoint(endpoint: str) -> str:
    """``host:port`` or ``tcp://host:port`` -> ``tcp://host:port``.

    CHP runs over TCP only, so a bare ``host:port`` can mean nothing else;
    refusing it (as ``clone --servers`` once did while ``clone-pipeline``
    accepted it) only made the same value fail in one tool and work in the
    other.  The port is a CHP *base* port P: P+1 and P+2 must exist too.
    Raises ``ValueError`` that names the endpoint and the expected form.
    """
    if not isinstance(endpoint, str):
        raise TypeError(f"a server endpoint must be str, not {type(endpoint).__name__}")
    text = endpoint.strip()
    rest = strip_scheme(text)
    if "://" in rest:
        raise ValueError(f"server {endpoint!r}: only tcp:// endpoints are supported")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or "/" in host or not (port.isascii() and port.isdigit()):
        raise ValueError(f"server {endpoint!r} is not of the form [tcp://]host:port")
    if not 0 < int(port) <= 65535 - COLLECTOR_OFFSET:
        raise ValueError(
            f"server {endpoint!r}: port {port} out of range "
            f"(a CHP base port P uses P..P+{COLLECTOR_OFFSET}, so 1..{65535 - COLLECTOR_OFFSET})"
        )
    return f"{_SCHEME}{host}:{int(port)}"


def normalize_endpoints(servers: str | Iterable[str]) -> list[str]:
    """A comma-separated string or a list of endpoints, each normalized; blanks skipped."""
    items = servers.split(",") if isinstance(servers, str) else servers
    return [normalize_endpoint(item) for item in items if item.strip()]


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``tcp://host:P`` -> (``tcp://host``, P); raises ValueError otherwise."""
    if not isinstance(endpoint, str):
        raise TypeError(f"endpoint must be str, not {type(endpoint).__name__}")
    head, sep, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not port.isdigit() or head == "tcp":
        raise ValueError(f"endpoint {endpoint!r} is not of the form tcp://host:port")
    base = int(port)
    if not 0 < base <= 65535 - COLLECTOR_OFFSET:
        raise ValueError(f"endpoint {endpoint!r}: port out of range")
    return head, base
