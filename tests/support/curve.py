"""Keys, an ACL and raw CURVE sockets for end-to-end tests of a secured server.

Usage::

    keys = CurveKeys.make(tmp_path, admitted=("admin", "reader"), strangers=("mallory",))
    keys.write_acl({"admin": ([""], [""]), "reader": (["/public/"], [])})
    server = servers.standalone(*keys.server_args(), wait=False)
    wait_serving_curve(server, keys)            # a CURVE ICANHAZ? answered
    with Clone([endpoint], **keys.client("reader")) as c: ...
    sock = curve_socket(ctx, zmq.SUB, keys, "reader")   # a raw CURVE client socket

``ServerProcess.wait_serving`` (and so ``servers.standalone(wait=True)`` and
``servers.pair(wait=True)``) asks in clear text, which a CURVE server never
answers: start secured servers with ``wait=False`` and use
:func:`wait_serving_curve`.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from clone.security import configure_client_socket, keygen, load_public, load_secret

__all__ = ["CurveKeys", "curve_answers_icanhaz", "curve_socket", "wait_serving_curve"]


@dataclass(frozen=True)
class CurveKeys:
    """The pair certificate, client certificates and the files a server reads.

    ``keys/`` holds every client's two files, ``clients/`` (``--clients``) the
    public certificates of the admitted ones, ``acl.toml`` the ACL.
    """

    root: Path
    pair_secret: Path
    pair_public: Path

    @property
    def clients(self) -> Path:
        return self.root / "clients"

    @property
    def acl(self) -> Path:
        return self.root / "acl.toml"

    @classmethod
    def make(
        cls, root: Path, admitted: Iterable[str] = (), strangers: Iterable[str] = ()
    ) -> CurveKeys:
        public, secret = keygen(root / "pair", "pair")
        keys = cls(root, secret, public)
        keys.clients.mkdir(mode=0o700)
        for name in admitted:
            keys.new_client(name, admit=True)
        for name in strangers:
            keys.new_client(name, admit=False)
        return keys

    def new_client(self, name: str, *, admit: bool) -> Path:
        """``clone keygen`` for ``name``; with ``admit``, its .key goes to ``clients/``."""
        _, secret = keygen(self.root / "keys", name)
        if admit:
            self.admit(name)
        return secret

    def admit(self, name: str) -> None:
        public = self.root / "keys" / f"{name}.key"
        shutil.copy(public, self.clients / public.name)

    def revoke(self, name: str) -> None:
        (self.clients / f"{name}.key").unlink()

    def secret(self, name: str) -> Path:
        return self.root / "keys" / f"{name}.key_secret"

    def public_z85(self, name: str) -> bytes:
        return load_public(self.root / "keys" / f"{name}.key")

    def write_acl(self, tables: Mapping[str, tuple[Sequence[str], Sequence[str]]]) -> None:
        """``{name: (read prefixes, write prefixes)}`` as a TOML ACL."""

        def toml_list(items: Sequence[str]) -> str:
            return "[" + ", ".join(f'"{item}"' for item in items) + "]"

        lines = []
        for name, (read, write) in tables.items():
            lines += [f'[client."{name}"]', f"read = {toml_list(read)}"]
            lines += [f"write = {toml_list(write)}", ""]
        tmp = self.acl.with_suffix(".tmp")
        tmp.write_text("\n".join(lines))
        tmp.replace(self.acl)  # atomic: a SIGHUP never reads half a file

    def server_args(self, *, acl: bool = True) -> list[str]:
        args = ["--curve-secret", str(self.pair_secret), "--clients", str(self.clients)]
        if acl:
            args += ["--acl", str(self.acl)]
        return args

    def client(self, name: str) -> dict[str, Any]:
        """``Clone(..., **keys.client(name))``."""
        return {"curve_secret": self.secret(name), "server_key": self.pair_public}


def curve_socket(ctx: zmq.Context[Any], kind: int, keys: CurveKeys, name: str) -> zmq.Socket[Any]:
    """A socket of ``kind`` that connects as the CURVE client ``name`` (linger 0)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    configure_client_socket(sock, load_secret(keys.secret(name)), load_public(keys.pair_public))
    return sock


def curve_answers_icanhaz(port: int, keys: CurveKeys, name: str, timeout: float) -> bool:
    """Whether a CURVE ICANHAZ? as ``name`` gets a KTHXBAI within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        while time.monotonic() < deadline:
            dealer = curve_socket(ctx, zmq.DEALER, keys, name)
            try:
                dealer.connect(f"tcp://127.0.0.1:{port}")
                # a refused handshake can leave no pipe: never block on it
                dealer.sndtimeo = 200
                try:
                    dealer.send_multipart([b"ICANHAZ?", b"/--wait-serving--/"])
                except zmq.Again:
                    continue
                while dealer.poll(200):
                    if dealer.recv_multipart()[0] == b"KTHXBAI":
                        return True
            finally:
                dealer.close(linger=0)
        return False
    finally:
        ctx.term()


def wait_serving_curve(
    server: Any, keys: CurveKeys, name: str = "admin", timeout: float = 10.0
) -> None:
    """``server.wait_serving`` over CURVE, as the admitted client ``name``."""
    if not curve_answers_icanhaz(server.port, keys, name, timeout):
        raise TimeoutError(
            f"{server.name} not serving over CURVE after {timeout} s;"
            f" log tail:\n{server.log_text()[-3000:]}"
        )
