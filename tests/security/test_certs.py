"""Certificate files: keygen, loading, fingerprints and the clients directory."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest
import zmq

from clone.errors import SecurityError
from clone.security import (
    PEER_USER,
    fingerprint,
    keygen,
    load_client_keys,
    load_public,
    load_secret,
)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keygen_writes_both_files_with_safe_modes(tmp_path: Path) -> None:
    directory = tmp_path / "certs"
    public, secret = keygen(directory, "alice")
    assert public == directory / "alice.key"
    assert secret == directory / "alice.key_secret"
    assert _mode(directory) == 0o700
    assert _mode(secret) == 0o600
    assert _mode(public) & 0o077 in (0o044, 0o004, 0o040, 0)  # whatever umask left
    assert sorted(p.name for p in directory.iterdir()) == ["alice.key", "alice.key_secret"]
    pair = load_secret(secret)
    assert load_public(public) == pair.public
    assert zmq.curve_public(pair.secret) == pair.public
    assert "secret" not in repr(pair).split("public=")[0] and pair.secret.decode() not in repr(pair)


def test_keygen_secret_never_world_readable_even_with_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        _, secret = keygen(tmp_path, "bob")
    finally:
        os.umask(old)
    assert _mode(secret) == 0o600


def test_keygen_keeps_an_existing_directory_mode(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    keygen(tmp_path, "carol")
    assert _mode(tmp_path) == 0o755


@pytest.mark.parametrize("existing", ["dave.key", "dave.key_secret"])
def test_keygen_refuses_to_overwrite(tmp_path: Path, existing: str) -> None:
    (tmp_path / existing).write_text("precious")
    with pytest.raises(SecurityError, match=f"refusing to overwrite .*{existing}"):
        keygen(tmp_path, "dave")
    assert (tmp_path / existing).read_text() == "precious"
    assert [p.name for p in tmp_path.iterdir()] == [existing]


@pytest.mark.parametrize("name", ["", "a/b", "../x", ".hidden", PEER_USER, " pad", "nul\x00"])
def test_keygen_refuses_names_that_are_not_plain_stems(tmp_path: Path, name: str) -> None:
    with pytest.raises(SecurityError, match="cannot create a certificate named"):
        keygen(tmp_path / "d", name)
    assert not (tmp_path / "d").exists()


def test_keygen_refuses_a_file_as_directory(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(SecurityError, match="not a directory"):
        keygen(tmp_path / "f", "x")


def test_load_secret_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SecurityError, match=r"no such certificate file.*clone keygen"):
        load_secret(tmp_path / "nope.key_secret")


def test_load_secret_of_a_directory(tmp_path: Path) -> None:
    with pytest.raises(SecurityError, match="not a regular file"):
        load_secret(tmp_path)


def test_load_secret_of_a_public_certificate(tmp_path: Path) -> None:
    public, _ = keygen(tmp_path, "srv")
    with pytest.raises(SecurityError, match=r"this is a public certificate; pass the \.key_secret"):
        load_secret(public)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_load_secret_unreadable(tmp_path: Path) -> None:
    _, secret = keygen(tmp_path, "srv")
    secret.chmod(0)
    with pytest.raises(SecurityError, match="cannot read the certificate"):
        load_secret(secret)


@pytest.mark.parametrize(
    "text, match",
    [
        ("hello\n", "no public-key"),
        (b"\xff\xfe\x00garbage", "no public-key"),
        ('curve\n    public-key = "short"\n    secret-key = "x"\n', "not a 40-character Z85"),
        ('curve\n    public-key = "' + "~" * 40 + '"\n', "not a 40-character Z85"),
    ],
)
def test_load_secret_malformed(tmp_path: Path, text: str | bytes, match: str) -> None:
    path = tmp_path / "bad.key_secret"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(SecurityError, match=match):
        load_secret(path)


def test_load_secret_mismatched_keys(tmp_path: Path) -> None:
    _, a = keygen(tmp_path, "a")
    other_public, _ = zmq.curve_keypair()
    text = a.read_text()
    original = load_secret(a).public.decode()
    bad = tmp_path / "bad.key_secret"
    bad.write_text(text.replace(original, other_public.decode()))
    bad.chmod(0o600)
    with pytest.raises(SecurityError, match="does not match"):
        load_secret(bad)


def test_load_secret_warns_when_group_or_world_readable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, secret = keygen(tmp_path, "srv")
    secret.chmod(0o644)
    with caplog.at_level(logging.WARNING, logger="clone.security.certs"):
        load_secret(secret)
    assert "chmod 600" in caplog.text and "0644" in caplog.text


def test_load_public_accepts_either_file(tmp_path: Path) -> None:
    public, secret = keygen(tmp_path, "srv")
    assert load_public(public) == load_public(secret)
    with pytest.raises(SecurityError, match="no such certificate"):
        load_public(tmp_path / "missing.key")


def test_fingerprint_is_short_stable_and_not_the_key() -> None:
    public, _ = zmq.curve_keypair()
    fp = fingerprint(public)
    assert fp == fingerprint(public)
    assert len(fp) == 12 and int(fp, 16) >= 0
    assert fp not in public.decode()
    other, _ = zmq.curve_keypair()
    assert fingerprint(other) != fp
    with pytest.raises(ValueError):
        fingerprint(b"short")


def test_load_client_keys_names_by_stem(tmp_path: Path) -> None:
    a, _ = keygen(tmp_path / "keys", "alice")
    b, _ = keygen(tmp_path / "keys", "bob")
    clients = tmp_path / "clients"
    clients.mkdir()
    for p in (a, b):
        (clients / p.name).write_bytes(p.read_bytes())
    (clients / "README").write_text("not a certificate, ignored")
    keys = load_client_keys(clients)
    assert dict(keys.names) == {load_public(a): "alice", load_public(b): "bob"}
    assert keys.problems == ()
    assert len(keys) == 2
    assert keys.name_of(load_public(a)) == "alice"


def test_load_client_keys_skips_bad_files_and_reports_them(tmp_path: Path) -> None:
    _, good_secret = keygen(tmp_path, "good")
    (tmp_path / "broken.key").write_text("garbage\n")
    (tmp_path / "leaky.key").write_bytes(good_secret.read_bytes().replace(b"good", b"leaky"))
    (tmp_path / "adir.key").mkdir()  # unreadable as a certificate, even for root
    keys = load_client_keys(tmp_path)
    # leaky is skipped before it could count as a duplicate of good
    assert set(keys.names.values()) == {"good"}
    problems = "\n".join(keys.problems)
    assert "adir.key: not a regular file" in problems
    assert "broken.key" in problems and "'broken' is not admitted" in problems
    assert "leaky.key: holds a secret key" in problems
    assert "good.key_secret: a secret certificate" in problems


def test_load_client_keys_good_alongside_broken(tmp_path: Path) -> None:
    keys_dir = tmp_path / "k"
    good, _ = keygen(keys_dir, "good")
    clients = tmp_path / "clients"
    clients.mkdir()
    (clients / "good.key").write_bytes(good.read_bytes())
    (clients / "broken.key").write_text("garbage\n")
    keys = load_client_keys(clients)
    assert list(keys.names.values()) == ["good"]
    assert len(keys.problems) == 1 and "broken" in keys.problems[0]


def test_load_client_keys_duplicate_key_admitted_under_neither(tmp_path: Path) -> None:
    keys_dir = tmp_path / "k"
    a, _ = keygen(keys_dir, "a")
    clients = tmp_path / "clients"
    clients.mkdir()
    (clients / "first.key").write_bytes(a.read_bytes())
    (clients / "second.key").write_bytes(a.read_bytes())
    keys = load_client_keys(clients)
    assert dict(keys.names) == {}
    (problem,) = keys.problems
    assert "first, second hold the same public key" in problem
    assert fingerprint(load_public(a)) in problem
    assert load_public(a).decode() not in problem


def test_load_client_keys_refuses_reserved_and_hidden_stems(tmp_path: Path) -> None:
    keys_dir = tmp_path / "k"
    a, _ = keygen(keys_dir, "a")
    clients = tmp_path / "clients"
    clients.mkdir()
    (clients / ".sneaky.key").write_bytes(a.read_bytes())
    keys = load_client_keys(clients)
    assert dict(keys.names) == {}
    assert "must not start with '.'" in keys.problems[0]


def test_load_client_keys_missing_or_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(SecurityError, match="does not exist; create it"):
        load_client_keys(tmp_path / "missing")
    (tmp_path / "file").write_text("")
    with pytest.raises(SecurityError, match="not a directory"):
        load_client_keys(tmp_path / "file")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_load_client_keys_unreadable_directory(tmp_path: Path) -> None:
    clients = tmp_path / "clients"
    clients.mkdir()
    clients.chmod(0)
    try:
        with pytest.raises(SecurityError, match="cannot read the clients directory"):
            load_client_keys(clients)
    finally:
        clients.chmod(0o700)


def test_load_secret_unreadable_even_as_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The permission branch without depending on the test's uid."""
    _, secret = keygen(tmp_path, "srv")

    def denied(path: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("zmq.auth.load_certificate", denied)
    with pytest.raises(SecurityError, match="cannot read the certificate: Permission denied"):
        load_secret(secret)
