"""The ACL file and Rights: table-driven, no sockets."""

from __future__ import annotations

from pathlib import Path

import pytest

from clone.errors import SecurityError
from clone.security import FULL, NOTHING, PEER_USER, Acl, Rights

GOOD = """
[client.reader]
read = ["/public/"]
write = []

[client.writer]
read = [""]
write = ["/public/", "/jobs/"]

[client.narrow]
read = ["/public/", "/public/x/", "/a/"]

[client.twin]
read = ["/a/", "/public/"]

[client."dotted.name"]
write = ["/w/"]
"""


def test_good_file(tmp_path: Path) -> None:
    path = tmp_path / "acl.toml"
    path.write_text(GOOD)
    acl = Acl.load(path)
    reader = acl.rights("reader")
    assert reader == Rights(read=(b"/public/",), write=())
    assert reader.can_read(b"/public/k") and not reader.can_read(b"/private/k")
    assert not reader.can_write(b"/public/k")
    writer = acl.rights("writer")
    assert writer.read_all and writer.can_read(b"anything")
    assert writer.can_write(b"/jobs/1") and not writer.can_write(b"/other")
    assert acl.rights("dotted.name") == Rights(read=(), write=(b"/w/",))
    assert acl.names == {"reader", "writer", "narrow", "twin", "dotted.name"}


def test_no_table_means_nothing_and_peer_means_full() -> None:
    acl = Acl.parse(GOOD)
    assert acl.rights("stranger") is NOTHING
    assert acl.rights(PEER_USER) is FULL
    assert not NOTHING.can_read(b"") and not NOTHING.can_write(b"x")


def test_allow_all() -> None:
    acl = Acl.allow_all()
    assert acl.rights("anyone") == FULL
    assert acl.views() == ()
    assert acl.names == frozenset()


def test_empty_file_gives_nobody_anything() -> None:
    acl = Acl.parse("")
    assert acl.rights("reader") == NOTHING
    assert acl.rights(PEER_USER) == FULL


def test_views_are_distinct_normalized_and_sorted() -> None:
    acl = Acl.parse(GOOD)
    # narrow and twin mean the same; writer reads all; dotted.name reads nothing
    assert acl.views() == ((), (b"/a/", b"/public/"), (b"/public/",))


@pytest.mark.parametrize(
    "read, expected",
    [
        ((), ()),
        ((b"",), (b"",)),
        ((b"/a/", b""), (b"",)),
        ((b"/b/", b"/a/", b"/a/"), (b"/a/", b"/b/")),
        ((b"/a/x", b"/a/"), (b"/a/",)),
        ((b"/ab", b"/a"), (b"/a",)),
    ],
)
def test_rights_normalize(read: tuple[bytes, ...], expected: tuple[bytes, ...]) -> None:
    assert Rights(read=read, write=()).read == expected


@pytest.mark.parametrize(
    "prefixes, key, allowed",
    [
        ((b"",), b"", True),
        ((b"",), b"/x", True),
        ((b"/a/",), b"/a/", True),
        ((b"/a/",), b"/a/b", True),
        ((b"/a/",), b"/a", False),
        ((b"/a/",), b"/b/a/", False),
        ((), b"/a/", False),
        ((b"/a/", b"/b/"), b"/b/1", True),
    ],
)
def test_rights_prefix_match(prefixes: tuple[bytes, ...], key: bytes, allowed: bool) -> None:
    rights = Rights(read=prefixes, write=prefixes)
    assert rights.can_read(key) is allowed
    assert rights.can_write(key) is allowed


def test_rights_reject_non_bytes() -> None:
    with pytest.raises(TypeError):
        Rights(read=("/a/",), write=())  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Rights(read=b"/a/", write=())  # type: ignore[arg-type]


def test_utf8_prefixes() -> None:
    acl = Acl.parse('[client.u]\nread = ["/é/"]\n')
    assert acl.rights("u").can_read("/é/k".encode())


@pytest.mark.parametrize(
    "text, match",
    [
        ("[client.a\n", "not valid TOML"),
        ('other = 1\n[client.a]\nread = [""]\n', "unknown top-level key.*'other'"),
        ("[server]\n", "unknown top-level key.*'server'"),
        ('client = "x"\n', "'client' must hold tables"),
        ("[client]\na = 1\n", r"table \[client.a\]: must be a table"),
        ('[client.a]\nread = [""]\nadmin = true\n', r"table \[client.a\]: unknown key.*'admin'"),
        ('[client.a]\nread = "/public/"\n', r"\[client.a\], key 'read': must be a list"),
        ("[client.a]\nwrite = [1]\n", r"\[client.a\], key 'write': 1 is not a string"),
        ('[client.a]\nread = [["/x/"]]\n', r"key 'read': \['/x/'\] is not a string"),
        (f'[client."{PEER_USER}"]\nread = [""]\n', "always has full access"),
    ],
)
def test_bad_files(text: str, match: str) -> None:
    with pytest.raises(SecurityError, match=match) as info:
        Acl.parse(text, source="acl.toml")
    assert "acl.toml" in str(info.value)


def test_load_missing_and_undecodable(tmp_path: Path) -> None:
    with pytest.raises(SecurityError, match="does not exist"):
        Acl.load(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(SecurityError, match="not UTF-8"):
        Acl.load(bad)
    with pytest.raises(SecurityError, match="cannot read"):
        Acl.load(tmp_path)  # a directory
