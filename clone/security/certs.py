"""CURVE certificate files: create them, read them, and list the admitted clients.

The files are the ones ``zmq.auth`` writes and reads (``NAME.key`` holds the
public key, ``NAME.key_secret`` both keys), so they interoperate with czmq and
pyzmq tools.  What this module adds is the part that decides security: every
way a file can be wrong becomes a :class:`~clone.errors.SecurityError` that says
which file and what to do, and nothing wrong ever turns into more access
(fail closed).

Keys are handled as Z85 text in bytes (40 characters), which is what
``setsockopt(CURVE_*KEY)`` takes and what a certificate file holds.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import zmq
import zmq.auth
from zmq.utils import z85

from clone.errors import SecurityError
from clone.security.names import name_problem

__all__ = [
    "PUBLIC_SUFFIX",
    "SECRET_SUFFIX",
    "ClientKeys",
    "KeyPair",
    "fingerprint",
    "keygen",
    "load_client_keys",
    "load_public",
    "load_secret",
]

logger = logging.getLogger(__name__)

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"

_Z85_KEY_LEN = 40  # a 32-byte key in Z85
_Z85_ALPHABET = frozenset(z85.Z85CHARS)
_FINGERPRINT_HEX = 12


@dataclass(frozen=True, slots=True)
class KeyPair:
    """A certificate's two keys, Z85 bytes, ready for ``setsockopt``.

    ``secret`` is left out of ``repr`` so that a debug log of a config object
    never leaks it.
    """

    public: bytes
    secret: bytes = field(repr=False)


@dataclass(frozen=True, slots=True)
class ClientKeys:
    """The clients admitted by one reading of the clients directory.

    ``names`` maps a Z85 public key to the client's name (its file stem).
    ``problems`` lists every file that was skipped and why; the caller logs
    them.  A skipped file is a client that is *not* admitted.
    """

    directory: Path | None
    names: Mapping[bytes, str]
    problems: tuple[str, ...] = ()

    def name_of(self, z85_public: bytes) -> str | None:
        """The admitted client holding this key, or ``None``."""
        return self.names.get(z85_public)

    def __len__(self) -> int:
        return len(self.names)


def _check_z85_key(key: bytes, path: Path, what: str) -> None:
    if len(key) != _Z85_KEY_LEN or not set(key) <= _Z85_ALPHABET:
        raise SecurityError(
            f"{path}: the {what} is not a 40-character Z85 CURVE key; the file is "
            f"damaged or not a ZeroMQ certificate: regenerate it with `clone keygen`"
        )


def _read_certificate(path: Path) -> tuple[bytes, bytes | None]:
    """(public, secret or None) of a certificate file, checked; SecurityError if unusable."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise SecurityError(
            f"{path}: no such certificate file; create one with "
            f"`clone keygen --dir DIR NAME` or fix the path"
        ) from None
    except OSError as e:
        raise SecurityError(f"{path}: cannot read the certificate: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise SecurityError(f"{path}: not a regular file; pass a certificate file")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError as e:
        raise SecurityError(
            f"{path}: cannot read the certificate: {e.strerror or e}; check its owner and mode"
        ) from None
    except ValueError:
        raise SecurityError(
            f"{path}: no public-key in it: not a ZeroMQ certificate file; "
            f"regenerate it with `clone keygen`"
        ) from None
    _check_z85_key(public, path, "public-key")
    if secret is not None:
        _check_z85_key(secret, path, "secret-key")
    return public, secret


def load_secret(path: str | os.PathLike[str]) -> KeyPair:
    """Both keys of a secret certificate (``NAME.key_secret``).

    Checks that the secret key really belongs to the public key in the file,
    so that an edited file fails here and not as a handshake that silently
    never completes.  Logs a warning if the file is readable by group or
    others: the key is still used (refusing would turn a permission slip into
    an outage), but the operator is told to fix it.
    """
    path = Path(path)
    public, secret = _read_certificate(path)
    if secret is None:
        raise SecurityError(
            f"{path}: this is a public certificate; pass the {SECRET_SUFFIX} file "
            f"(e.g. {path.with_suffix(SECRET_SUFFIX)})"
        )
    if zmq.curve_public(secret) != public:
        raise SecurityError(
            f"{path}: the secret-key does not match the public-key; the file was "
            f"edited or damaged: regenerate it with `clone keygen`"
        )
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        logger.warning(
            "%s holds a secret key but is readable by group or others (mode %04o); "
            "run: chmod 600 %s",
            path,
            mode,
            path,
        )
    return KeyPair(public=public, secret=secret)


def load_public(path: str | os.PathLike[str]) -> bytes:
    """The public key (Z85) of a certificate: the ``.key`` or the ``.key_secret`` file.

    A client given ``server_key=FILE`` only needs the server's public key;
    accepting either file saves a round of "which one did you mean".
    """
    public, _ = _read_certificate(Path(path))
    return public


def fingerprint(z85_public: bytes) -> str:
    """A short stable id of a public key for logs: 12 hex digits of its SHA-256.

    Logs carry this and never the key, so that a log line can be matched to a
    certificate (``clone keygen`` prints the same id) without the log becoming a
    list of keys to try.
    """
    if len(z85_public) != _Z85_KEY_LEN:
        raise ValueError(f"a Z85 CURVE key is {_Z85_KEY_LEN} bytes, not {len(z85_public)}")
    return hashlib.sha256(z85.decode(z85_public)).hexdigest()[:_FINGERPRINT_HEX]


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` with ``mode`` from the first byte on; never replace a file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, data)
        os.fchmod(fd, mode)
        os.fsync(fd)
    finally:
        os.close(fd)


def keygen(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write ``DIR/NAME.key`` (public) and ``DIR/NAME.key_secret`` (secret, 0600).

    ``zmq.auth.create_certificates`` writes with the process umask and
    truncates existing files, so it runs in a private (0700) scratch directory
    and the results are copied to their final names with ``O_EXCL`` and their
    final mode: the secret is never readable by others, not even for a moment,
    and an existing certificate is never overwritten.  ``DIR`` is created 0700
    if missing.  Returns (public path, secret path).
    """
    problem = name_problem(name)
    if problem is not None:
        raise SecurityError(f"cannot create a certificate named {name!r}: {problem}")
    directory = Path(directory)
    if not directory.exists():
        try:
            directory.mkdir(mode=0o700, parents=True)
            directory.chmod(0o700)
        except OSError as e:
            raise SecurityError(f"cannot create {directory}: {e.strerror}") from None
    elif not directory.is_dir():
        raise SecurityError(f"{directory} exists and is not a directory")
    public_path = directory / f"{name}{PUBLIC_SUFFIX}"
    secret_path = directory / f"{name}{SECRET_SUFFIX}"
    existing = [str(p) for p in (public_path, secret_path) if os.path.lexists(p)]
    if existing:
        raise SecurityError(
            f"refusing to overwrite {' and '.join(existing)}: remove them first "
            f"or choose another name"
        )
    try:
        scratch = Path(tempfile.mkdtemp(prefix=".keygen-", dir=directory))
    except OSError as e:
        raise SecurityError(f"cannot write in {directory}: {e.strerror}") from None
    try:
        made_public, made_secret = zmq.auth.create_certificates(scratch, name)
        secret_bytes = Path(made_secret).read_bytes()
        public_bytes = Path(made_public).read_bytes()
        try:
            _write_new(secret_path, secret_bytes, 0o600)
        except FileExistsError:
            raise SecurityError(
                f"refusing to overwrite {secret_path}: it appeared while writing"
            ) from None
        try:
            _write_new(public_path, public_bytes, 0o644)
        except OSError as e:
            secret_path.unlink(missing_ok=True)
            if isinstance(e, FileExistsError):
                raise SecurityError(
                    f"refusing to overwrite {public_path}: it appeared while writing"
                ) from None
            raise SecurityError(f"cannot write {public_path}: {e.strerror}") from None
    except OSError as e:
        raise SecurityError(f"cannot write the certificate in {directory}: {e}") from None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return public_path, secret_path


def load_client_keys(directory: str | os.PathLike[str]) -> ClientKeys:
    """Read every public certificate ``DIR/*.key`` into {Z85 key: name}.

    A missing or unreadable directory raises :class:`SecurityError`: at start
    the server must refuse to run rather than admit nobody without saying so;
    on a reload the caller catches it and keeps the keys it had.  A file that
    cannot be used is skipped and listed in ``problems``, and a key found in
    two files is admitted under neither name (each name could be the one the
    ACL restricts).  Fail closed throughout: doubt means not admitted.
    """
    directory = Path(directory)
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except FileNotFoundError:
        raise SecurityError(
            f"clients directory {directory} does not exist; create it and put the "
            f"public certificates (NAME{PUBLIC_SUFFIX}) of the allowed clients in it"
        ) from None
    except NotADirectoryError:
        raise SecurityError(f"clients directory {directory} is not a directory") from None
    except OSError as e:
        raise SecurityError(
            f"cannot read the clients directory {directory}: {e.strerror}"
        ) from None

    problems: list[str] = []
    holders: dict[bytes, list[str]] = {}
    for entry in entries:
        path = directory / entry.name
        if entry.name.endswith(SECRET_SUFFIX):
            problems.append(
                f"{path}: a secret certificate in the clients directory; move it "
                f"away (only public {PUBLIC_SUFFIX} files belong here)"
            )
            continue
        if not entry.name.endswith(PUBLIC_SUFFIX):
            continue
        stem = entry.name[: -len(PUBLIC_SUFFIX)]
        problem = name_problem(stem)
        if problem is not None:
            problems.append(f"{path}: skipped, not admitted: {problem}")
            continue
        try:
            public, secret = _read_certificate(path)
        except SecurityError as e:
            problems.append(f"{e}; client {stem!r} is not admitted")
            continue
        if secret is not None:
            problems.append(
                f"{path}: holds a secret key; put only public certificates in the "
                f"clients directory; client {stem!r} is not admitted"
            )
            continue
        holders.setdefault(public, []).append(stem)

    names: dict[bytes, str] = {}
    for public, stems in holders.items():
        if len(stems) > 1:
            problems.append(
                f"{directory}: {', '.join(stems)} hold the same public key "
                f"(fingerprint {fingerprint(public)}); none of them is admitted "
                f"until only one remains"
            )
            continue
        names[public] = stems[0]
    return ClientKeys(directory=directory, names=MappingProxyType(names), problems=tuple(problems))
