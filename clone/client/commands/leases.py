"""``clone lease grant|keep-alive|revoke|list`` and ``clone elect``.

A lease outlives the ``clone`` process that granted it only if some process
keeps it alive (``clone lease keep-alive ID``, in the foreground, as etcdctl's),
and only its owner may: under CURVE the client's certificate, without CURVE a
secret.  ``lease grant`` uses ``--lease-secret``/``$CLONE_LEASE_SECRET`` if
given, else makes one and prints it as ``CLONE_LEASE_SECRET=...``, which the
other lease commands and ``set --lease`` read back.  ``lease list`` shows the
leases whose recorded owner is that secret's hash (or, under CURVE, the
certificate's name).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import secrets
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clone.client.commands.kv import LEASE_SECRET_ENV, add_lease_secret
from clone.client.commands.output import (
    EXIT_ERROR,
    EXIT_MISSING,
    EXIT_OK,
    EXIT_UNREACHABLE,
    emit,
    fail,
)

if TYPE_CHECKING:
    from types import FrameType

    from clone.client.frontend import Clone

_LEASE_PREFIX = "/_clone/lease/"
_SECRET_SUFFIX = ".key_secret"


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    lease = sub.add_parser("lease", help="grant, keep alive, revoke and list leases")
    verbs = lease.add_subparsers(dest="lease_command", required=True, metavar="VERB")
    grant = verbs.add_parser(
        "grant", parents=[common], help="grant a lease of TTL seconds; print its id and secret"
    )
    grant.add_argument("ttl", type=float, metavar="TTL")
    add_lease_secret(grant)
    grant.set_defaults(handler=run_grant)
    keep = verbs.add_parser(
        "keep-alive", parents=[common], help="keep lease ID alive until interrupted"
    )
    keep.add_argument("id", metavar="ID")
    keep.add_argument(
        "--ttl", type=float, default=None, metavar="S",
        help="the lease's ttl (default: read from the lease's key)",
    )  # fmt: skip
    add_lease_secret(keep)
    keep.set_defaults(handler=run_keep_alive)
    revoke = verbs.add_parser(
        "revoke", parents=[common], help="end lease ID now: its keys are deleted"
    )
    revoke.add_argument("id", metavar="ID")
    add_lease_secret(revoke)
    revoke.set_defaults(handler=run_revoke)
    listing = verbs.add_parser("list", parents=[common], help="the caller's own leases")
    add_lease_secret(listing)
    listing.set_defaults(handler=run_list)

    elect = sub.add_parser(
        "elect",
        parents=[common],
        help="campaign as PROPOSAL in election NAME, print the leader, hold until killed",
    )
    elect.add_argument("name", metavar="NAME")
    elect.add_argument("proposal", nargs="?", metavar="PROPOSAL")
    elect.add_argument(
        "--listen", action="store_true", help="only print the leader each time it changes"
    )
    elect.add_argument("--ttl", type=float, default=5.0, metavar="S", help="lease ttl (5)")
    elect.set_defaults(handler=run_elect)


def check(args: argparse.Namespace) -> str | None:
    if args.command == "elect" and (args.proposal is None) != args.listen:
        return "elect takes NAME PROPOSAL, or --listen NAME"
    return None


def _secret(args: argparse.Namespace) -> str:
    return str(args.lease_secret or os.environ.get(LEASE_SECRET_ENV, ""))


@contextlib.contextmanager
def _held_until_signal() -> Iterator[None]:
    """Make SIGTERM and SIGHUP end the command as Ctrl-C does
    (KeyboardInterrupt) while it holds, then put their handlers back as they
    were, also on an exception: a program that calls ``main()`` in-process
    must not be left with a SIGTERM that raises KeyboardInterrupt.  A handler
    that Python did not install (``getsignal`` gives None: an embedding C
    program's) could not be put back, so that signal is left alone."""

    def stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, stop)
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)


def run_grant(args: argparse.Namespace, client: Clone) -> int:
    given = _secret(args)
    curve = args.curve_secret_in_use
    secret = given or ("" if curve else secrets.token_hex(16))
    lease = client.lease(args.ttl, timeout=args.timeout, secret=secret or None)
    lease._mark_ended()  # the lease outlives us: our close() must not revoke it
    # Under CURVE the certificate is the proof: the server ignores the secret.
    shown = "" if given or curve else lease._secret
    if args.json:
        emit(json.dumps({"id": lease.id, "ttl": lease.ttl, "secret": shown or None}))
        return EXIT_OK
    emit(f"lease {lease.id} granted with ttl {lease.ttl:g}s")
    if shown:
        emit(f"{LEASE_SECRET_ENV}={shown}")
    return EXIT_OK


def _ttl_of(client: Clone, lease_id: str) -> float | None:
    entry = client.entry(_LEASE_PREFIX + lease_id)
    if entry is None or entry.value is None:
        return None
    name, _, value = entry.value.decode("ascii", "replace").partition("=")
    try:
        return float(value) if name == "ttl" else None
    except ValueError:
        return None


def run_keep_alive(args: argparse.Namespace, client: Clone) -> int:
    ttl = args.ttl if args.ttl is not None else _ttl_of(client, args.id)
    if ttl is None:
        fail(f"lease {args.id} not found (expired or revoked; or give --ttl if this client"
             " may not read /_clone/lease/)")
        return EXIT_MISSING
    lease = client.adopt_lease(args.id, ttl, secret=_secret(args))
    with _held_until_signal():
        emit(f"lease {args.id} kept alive (ttl {ttl:g}s) until interrupted")
        try:
            lease.wait_lost()
        except KeyboardInterrupt:
            lease._mark_ended()  # stop keeping it: it ends a ttl later, as etcdctl's
            return EXIT_OK
    fail(f"lease {args.id} lost: {lease.why}")
    return EXIT_ERROR


def run_revoke(args: argparse.Namespace, client: Clone) -> int:
    from clone.client.leases import Lease

    Lease(client, args.id, 0.0, _secret(args)).revoke(args.timeout)
    if args.json:
        emit(json.dumps({"id": args.id, "revoked": True}))
    else:
        emit(f"lease {args.id} revoked")
    return EXIT_OK


def owner_of(secret: str, curve_secret: str | None) -> str | None:
    """The ``owner=`` a lease key of ours records (docs/protocol.md, "Lease
    ownership"): the certificate's name under CURVE (the server names a client
    after its key file, NAME.key), else the secret's SHA-256."""
    if curve_secret:
        name = Path(curve_secret).name
        return "name:" + (name[: -len(_SECRET_SUFFIX)] if name.endswith(_SECRET_SUFFIX) else name)
    if secret:
        return "secret:" + hashlib.sha256(secret.encode("ascii")).hexdigest()
    return None


def run_list(args: argparse.Namespace, client: Clone) -> int:
    owner = owner_of(_secret(args), args.curve_secret_in_use)
    if owner is None:
        fail(f"whose leases? give --lease-secret (or ${LEASE_SECRET_ENV}), or connect with CURVE")
        return EXIT_UNREACHABLE
    bound: dict[str, int] = {}
    for entry in client.entries():
        if entry.lease is not None:
            bound[entry.lease] = bound.get(entry.lease, 0) + 1
    for entry in client.entries(_LEASE_PREFIX):
        if entry.prop("owner") != owner or entry.value is None:
            continue
        lease_id = entry.key[len(_LEASE_PREFIX):]
        ttl = _ttl_of(client, lease_id)
        keys = bound.get(lease_id, 0)
        if args.json:
            emit(json.dumps({"id": lease_id, "ttl": ttl, "keys": keys}))
        else:
            emit(f"{lease_id} ttl={ttl:g}s keys={keys}" if ttl else f"{lease_id} keys={keys}")
    return EXIT_OK


def run_elect(args: argparse.Namespace, client: Clone) -> int:
    from clone.recipes import Election

    def changed(leader: str | None) -> None:
        try:
            if args.json:
                emit(json.dumps({"name": args.name, "leader": leader}))
            elif leader is not None:
                emit(leader)
        except BrokenPipeError:
            os.kill(os.getpid(), signal.SIGTERM)

    election = Election(
        client, args.name, args.proposal or "-", ttl=args.ttl, on_change=changed
    )
    with _held_until_signal():
        try:
            if args.listen:
                election.watch()
            else:
                election.campaign()
            signal.pause()
        except KeyboardInterrupt:
            pass
        finally:
            election.close()
    sys.stdout.flush()
    return EXIT_OK
