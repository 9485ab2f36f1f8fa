"""``clone get``, ``clone set`` and ``clone del`` (also ``del --prefix``).

Values are bytes end to end: a value argument is turned back into the exact
bytes the shell passed (``os.fsencode``: what Python decoded with
surrogateescape), ``--file PATH`` and ``-`` (stdin) are read as bytes, and
``get --raw``/``--output FILE`` write the stored bytes with nothing added.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

from clone.client.commands.output import (
    EXIT_CONFLICT,
    EXIT_MISSING,
    EXIT_OK,
    EXIT_UNREACHABLE,
    emit,
    fail,
    value_fields,
)

if TYPE_CHECKING:
    from clone.client.frontend import Clone

#: Where the servers keep leases; never the user's to delete.
RESERVED_PREFIX = "/_clone/"
#: The variable that holds a lease's secret for ``set --lease`` (``clone lease grant``).
LEASE_SECRET_ENV = "CLONE_LEASE_SECRET"


def sequence(text: str) -> int:
    """A sequence number argument: a whole number in 0..2**64-1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a sequence number") from None
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"{value} is not a sequence number (0..2**64-1)")
    return value


def add_lease_secret(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lease-secret",
        metavar="HEX",
        help=f"the lease's secret, as `clone lease grant` printed it (default: ${LEASE_SECRET_ENV};"
        " not needed under CURVE)",
    )


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    get = sub.add_parser("get", parents=[common], help="print a key's value (exit 1 if absent)")
    get.add_argument("key")
    out = get.add_mutually_exclusive_group()
    out.add_argument(
        "--raw", action="store_true", help="write the value's bytes exactly, no newline added"
    )
    out.add_argument(
        "-o", "--output", metavar="FILE", help="write the value's bytes exactly to FILE"
    )
    get.set_defaults(handler=run_get)

    set_ = sub.add_parser(
        "set",
        parents=[common],
        help="write a key, wait until the server confirms it, print its new sequence",
    )
    set_.add_argument("key")
    set_.add_argument(
        "value", nargs="?", help="the value; '-' reads it from stdin (bytes kept exactly)"
    )
    set_.add_argument("--file", metavar="PATH", help="read the value from PATH (bytes exactly)")
    set_.add_argument("--ttl", type=float, default=0, metavar="SECONDS", help="expire after")
    cas = set_.add_mutually_exclusive_group()
    cas.add_argument(
        "--if-seq",
        type=sequence,
        default=None,
        metavar="N",
        help="write only if the key is at sequence N (0: only if absent); exit 5 with"
        " the key's current sequence otherwise",
    )
    cas.add_argument(
        "--if-absent", action="store_true", help="write only if the key is absent (--if-seq 0)"
    )
    set_.add_argument(
        "--lease", metavar="ID", help="bind the key to lease ID (deleted when the lease ends)"
    )
    add_lease_secret(set_)
    set_.set_defaults(handler=run_set)

    delete = sub.add_parser(
        "del", parents=[common], help="delete a key, or every key under --prefix (confirmed)"
    )
    delete.add_argument("key", nargs="?")
    delete.add_argument("--if-seq", type=sequence, default=None, metavar="N", help="as for set")
    delete.add_argument(
        "--prefix", metavar="P", help="delete every key starting with P; prints how many"
    )
    delete.add_argument(
        "--dry-run", action="store_true", help="with --prefix: list the keys, delete nothing"
    )
    delete.set_defaults(handler=run_del)


def check(args: argparse.Namespace) -> str | None:
    """Usage errors found before connecting: the message, or None."""
    if args.command == "set":
        if args.file is not None and args.value is not None:
            return "set takes a VALUE or --file PATH, not both"
        if args.file is None and args.value is None:
            return "set needs a VALUE (or - for stdin, or --file PATH)"
        if args.value == "":
            return (
                f"an empty value would delete the key; use 'clone del {args.key}' to delete"
            )
    if args.command == "del":
        if (args.prefix is None) == (args.key is None):
            return "del takes a KEY or --prefix P (not both)"
        if args.prefix is not None and args.if_seq is not None:
            return "--if-seq is for one key, not with --prefix"
        if args.dry_run and args.prefix is None:
            return "--dry-run is for --prefix"
        if args.prefix == "":
            return "--prefix '' would delete every key; name a prefix"
    return None


def read_value(args: argparse.Namespace) -> bytes:
    """The value's exact bytes: the argument, ``--file``, or stdin for ``-``."""
    if args.file is not None:
        with open(args.file, "rb") as f:
            return f.read()
    if args.value == "-":
        return sys.stdin.buffer.read()
    return os.fsencode(args.value)  # back to the bytes the shell passed


def run_get(args: argparse.Namespace, client: Clone) -> int:
    # _rows, not entry(): the only place the update's uuid is kept.
    row = next((r for k, r in client._rows(args.key) if k == args.key), None)
    if row is None:
        fail(f"key {args.key!r} not found")
        return EXIT_MISSING
    seq, uuid, props, value = row
    if args.output is not None:
        with open(args.output, "wb") as f:
            f.write(value)
        return EXIT_OK
    if args.json:
        named = dict(props)
        ttl = named.get("ttl")
        obj: dict[str, object] = {"key": args.key, **value_fields(value), "sequence": seq}
        obj["ttl"] = float(ttl) if ttl is not None else None
        obj["lease"] = named.get("lease")
        obj["uuid"] = uuid.hex()
        obj["properties"] = named
        emit(json.dumps(obj, ensure_ascii=False))
        return EXIT_OK
    sys.stdout.buffer.write(value if args.raw else value + b"\n")
    sys.stdout.flush()
    return EXIT_OK


def run_set(args: argparse.Namespace, client: Clone) -> int:
    from clone.client.leases import Lease
    from clone.errors import Conflict

    value = read_value(args)
    if not value:
        fail(f"the value is empty, which would delete the key; use 'clone del {args.key}'")
        return EXIT_UNREACHABLE
    if_seq = 0 if args.if_absent else args.if_seq
    lease: Lease | None = None
    if args.lease is not None:
        secret = args.lease_secret or os.environ.get(LEASE_SECRET_ENV, "")
        # Not adopted: this process binds the key, the lease's owner keeps it alive.
        lease = Lease(client, args.lease, 0.0, secret)
    try:
        new = client.set(
            args.key, value, args.ttl, wait=True, timeout=args.timeout,
            if_sequence=if_seq, lease=lease,
        )  # fmt: skip
    except Conflict as exc:
        fail(str(exc))
        emit(json.dumps({"key": args.key, "current": exc.current}) if args.json
             else str(exc.current))
        return EXIT_CONFLICT
    emit(json.dumps({"key": args.key, "sequence": new}) if args.json else str(new))
    return EXIT_OK


def run_del(args: argparse.Namespace, client: Clone) -> int:
    from clone.errors import Conflict

    if args.prefix is not None:
        return _del_prefix(args, client)
    try:
        new = client.delete(args.key, wait=True, timeout=args.timeout, if_sequence=args.if_seq)
    except Conflict as exc:
        fail(str(exc))
        emit(json.dumps({"key": args.key, "current": exc.current}) if args.json
             else str(exc.current))
        return EXIT_CONFLICT
    if args.json:
        emit(json.dumps({"key": args.key, "sequence": new}))
    return EXIT_OK


def _del_prefix(args: argparse.Namespace, client: Clone) -> int:
    """Every key under the prefix in our replica, each delete confirmed."""
    from concurrent.futures import wait

    keys = [e.key for e in client.entries(args.prefix) if not e.key.startswith(RESERVED_PREFIX)]
    if args.dry_run:
        for key in keys:
            emit(json.dumps({"key": key}) if args.json else key)
        return EXIT_OK
    pending = [client.delete_async(key, timeout=args.timeout) for key in keys]
    wait(pending)
    failed = [exc for exc in (fut.exception() for fut in pending) if exc is not None]
    if failed:
        fail(f"deleted {len(keys) - len(failed)} of {len(keys)} keys under {args.prefix}")
        raise failed[0]  # (ConfirmTimeout: exit 3, WriteRefused: exit 4)
    if args.json:
        emit(json.dumps({"prefix": args.prefix, "deleted": len(keys)}))
    else:
        emit(f"deleted {len(keys)} keys under {args.prefix}")
    return EXIT_OK
