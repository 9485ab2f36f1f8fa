"""Who may read and write which keys: the ACL file and the rights it gives.

How this works: the ACL is a TOML file with one table per client, named by the
stem of the client's public certificate, each with ``read`` and ``write``
lists of key prefixes::

    [client.reader]
    read = ["/public/"]
    write = []

    [client.writer]
    read = [""]          # "" is every key
    write = ["/public/", "/jobs/"]

A missing list is an empty one; a client with no table may do nothing; the
server pair's own certificate (:data:`~clone.security.names.PEER_USER`) may
always do everything.  Anything the parser does not understand is an error
naming the file, the table and the key, never a guess: the server refuses to
start, or keeps its old ACL on a reload.

Pure apart from reading the one file in :meth:`Acl.load`; :meth:`Acl.parse`
takes the text.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from clone.errors import SecurityError
from clone.security.names import PEER_USER

__all__ = ["FULL", "NOTHING", "Acl", "Rights"]

_LISTS = ("read", "write")


def _normalize(prefixes: Iterable[bytes]) -> tuple[bytes, ...]:
    """Sorted, without duplicates and without prefixes another one already covers.

    Two clients whose lists mean the same thing get equal tuples, so that
    :meth:`Acl.views` does not count one view twice.
    """
    kept: list[bytes] = []
    for prefix in sorted(set(prefixes)):  # a covering prefix sorts before what it covers
        if not any(prefix.startswith(k) for k in kept):
            kept.append(prefix)
    return tuple(kept)


@dataclass(frozen=True, slots=True)
class Rights:
    """The key prefixes one client may read and write (raw key bytes).

    The prefix ``b""`` matches every key.  The tuples are normalized on
    construction (sorted, deduplicated, covered prefixes dropped).
    """

    read: tuple[bytes, ...]
    write: tuple[bytes, ...]

    def __post_init__(self) -> None:
        for which in _LISTS:
            value = getattr(self, which)
            if isinstance(value, (bytes, str)) or not all(isinstance(p, bytes) for p in value):
                raise TypeError(f"Rights.{which} must be a tuple of bytes prefixes")
            object.__setattr__(self, which, _normalize(value))

    def can_read(self, key: bytes) -> bool:
        """Whether ``key`` starts with one of the read prefixes."""
        return any(key.startswith(p) for p in self.read)

    def can_write(self, key: bytes) -> bool:
        """Whether ``key`` starts with one of the write prefixes."""
        return any(key.startswith(p) for p in self.write)

    @property
    def read_all(self) -> bool:
        """Whether this client sees every key (no filtering needed)."""
        return self.read == (b"",)


FULL = Rights(read=(b"",), write=(b"",))
NOTHING = Rights(read=(), write=())


@dataclass(frozen=True, slots=True)
class Acl:
    """The rights of every named client; see the module docstring for the file.

    ``clients`` is ``None`` for :meth:`allow_all` (no ``--acl``: every admitted
    client has :data:`FULL`).
    """

    clients: Mapping[str, Rights] | None
    source: str = "<no ACL>"

    TABLE: ClassVar[str] = "client"

    @classmethod
    def allow_all(cls) -> Acl:
        """The ACL of a server started without ``--acl``: every admitted client FULL."""
        return cls(clients=None)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Acl:
        """Read and check the ACL file; :class:`SecurityError` for anything wrong."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise SecurityError(f"ACL file {path} does not exist; fix the --acl path") from None
        except OSError as e:
            raise SecurityError(f"cannot read the ACL file {path}: {e.strerror}") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SecurityError(f"ACL file {path}: not UTF-8 text ({e.reason})") from None
        return cls.parse(text, source=os.fspath(path))

    @classmethod
    def parse(cls, text: str, source: str = "<ACL>") -> Acl:
        """Check the ACL given as TOML text; ``source`` names it in errors."""
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise SecurityError(f"ACL file {source}: not valid TOML: {e}") from None
        extra = sorted(k for k in doc if k != cls.TABLE)
        if extra:
            raise SecurityError(
                f"ACL file {source}: unknown top-level key(s) {', '.join(map(repr, extra))}; "
                f"only [{cls.TABLE}.NAME] tables are allowed"
            )
        tables = doc.get(cls.TABLE, {})
        if not isinstance(tables, dict):
            raise SecurityError(
                f"ACL file {source}: {cls.TABLE!r} must hold tables [{cls.TABLE}.NAME], "
                f"not a {type(tables).__name__}"
            )
        clients: dict[str, Rights] = {}
        for name, table in tables.items():
            where = f"ACL file {source}, table [{cls.TABLE}.{name}]"
            if name == PEER_USER:
                raise SecurityError(
                    f"{where}: {PEER_USER!r} is the server pair's own certificate, which "
                    f"always has full access; remove the table"
                )
            if not isinstance(table, dict):
                raise SecurityError(
                    f"{where}: must be a table with read/write lists, not a {type(table).__name__}"
                )
            unknown = sorted(k for k in table if k not in _LISTS)
            if unknown:
                raise SecurityError(
                    f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; "
                    f"only 'read' and 'write' are allowed"
                )
            lists: dict[str, tuple[bytes, ...]] = {}
            for which in _LISTS:
                value = table.get(which, [])
                if not isinstance(value, list):
                    raise SecurityError(
                        f"{where}, key {which!r}: must be a list of prefix strings, "
                        f'e.g. {which} = ["/public/"], not a {type(value).__name__}'
                    )
                for item in value:
                    if not isinstance(item, str):
                        raise SecurityError(
                            f"{where}, key {which!r}: {item!r} is not a string; "
                            f'prefixes are strings ("" means every key)'
                        )
                lists[which] = tuple(p.encode("utf-8") for p in value)
            clients[name] = Rights(read=lists["read"], write=lists["write"])
        return cls(clients=MappingProxyType(clients), source=source)

    def rights(self, name: str) -> Rights:
        """What client ``name`` may do: its table, FULL for the pair peer, else NOTHING."""
        if name == PEER_USER or self.clients is None:
            return FULL
        return self.clients.get(name, NOTHING)

    @property
    def names(self) -> frozenset[str]:
        """The clients that have a table (empty for :meth:`allow_all`).

        For a check at start and on reload: a table whose name has no
        certificate in the clients directory is probably a typo.
        """
        return frozenset(self.clients or ())

    def views(self) -> tuple[tuple[bytes, ...], ...]:
        """The distinct read-prefix sets of the clients that do not read everything.

        Each view is a sorted tuple of prefixes (possibly empty, for a client
        that may read nothing); the tuple of views is sorted too, so that the
        server's per-view bookkeeping is deterministic.
        """
        if self.clients is None:
            return ()
        return tuple(sorted({r.read for r in self.clients.values() if not r.read_all}))
