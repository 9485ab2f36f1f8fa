"""The commands that talk to servers without keeping a replica: ``clone
keygen``, ``backup``, ``status`` and ``conflicts``.

Each opens only the sockets its job needs (:mod:`clone.client.backup`,
:mod:`clone.client.status`, :mod:`clone.client.conflicts`), not a
:class:`~clone.Clone`; their parsers are built in :mod:`clone.client.cli`,
which runs them from :data:`COMMANDS` before connecting anything.  The client
library is imported inside each, for a fast ``--help``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from clone.client.commands.output import (
    EXIT_BROKEN_PIPE,
    EXIT_ERROR,
    EXIT_MISSING,
    EXIT_OK,
    EXIT_UNREACHABLE,
    discard_stdout,
    emit,
    fail,
    waiting,
)

__all__ = [
    "BACKUP_TIMEOUT",
    "COMMANDS",
    "STATUS_TIMEOUT",
    "backup",
    "conflicts",
    "curve_files",
    "keygen",
    "status",
]


def curve_files(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """The pair as resolved from one layer (flags, environment, file); the
    library's own reading of the environment when the namespace has none (a
    caller that built it with the bare parser)."""
    if args.curve_secret is not None or args.server_key is not None:
        return args.curve_secret, args.server_key
    from clone.client.frontend import default_curve_files

    return default_curve_files()


def keygen(args: argparse.Namespace) -> int:
    """``clone keygen --dir DIR NAME``: :func:`clone.security.keygen`."""
    from clone.errors import SecurityError
    from clone.security import fingerprint, keygen, load_public

    try:
        public, secret = keygen(args.dir, args.name)
        # What the server logs for this key, to tell it apart from others there.
        print_ = fingerprint(load_public(public))
    except SecurityError as exc:
        print(f"clone: {exc}", file=sys.stderr)
        return EXIT_ERROR
    emit(str(public))
    emit(str(secret))
    emit(f"fingerprint {print_}")
    return EXIT_OK


BACKUP_TIMEOUT = 10.0


def backup(args: argparse.Namespace) -> int:
    """``clone backup FILE``: its own sockets (:mod:`clone.client.backup`), not a
    :class:`Clone`, which keeps decoded values rather than the frames a
    restored server must serve byte for byte."""
    from clone.argtypes import normalize_endpoints
    from clone.client.backup import check_writable, take_backup, write_backup
    from clone.client.frontend import default_servers, load_curve_keys
    from clone.errors import CloneError, NotSynced, SecurityError

    timeout = args.backup_timeout
    if timeout is None:
        timeout = args.timeout if args.timeout_given else BACKUP_TIMEOUT
    if not timeout > 0:
        print("clone: --timeout must be > 0", file=sys.stderr)
        return EXIT_UNREACHABLE
    start = time.monotonic()
    try:
        servers = normalize_endpoints(args.servers or default_servers())
        curve = load_curve_keys(*curve_files(args))
        check_writable(args.file)
        with waiting("backup", timeout):
            copy = take_backup(servers, timeout=timeout, silence=2.5 * args.heartbeat,
                               curve=curve)
        write_backup(args.file, copy)
    except (ValueError, TypeError, SecurityError) as exc:
        print(f"clone: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except NotSynced as exc:
        print(f"clone: backup failed: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except CloneError as exc:
        print(f"clone: backup to {args.file} failed: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    elapsed = time.monotonic() - start
    emit(
        f"wrote {len(copy.entries)} keys at sequence {copy.sequence} to {args.file} "
        f"in {elapsed:.2f} s"
    )
    return EXIT_OK


STATUS_TIMEOUT = 2.0


def status(args: argparse.Namespace) -> int:
    """``clone status [--json]``: STATUS? to every server (:mod:`clone.client.status`).

    Exit 0 when every server answered, 2 when any did not (each is still
    reported, as unreachable), like ``etcdctl endpoint status``.
    """
    import json

    from clone.argtypes import normalize_endpoints
    from clone.client.frontend import default_servers, load_curve_keys
    from clone.client.status import query_status, status_table
    from clone.errors import SecurityError

    timeout = args.status_timeout
    if timeout is None:
        timeout = args.timeout if args.timeout_given else STATUS_TIMEOUT
    if not timeout > 0:
        print("clone: --timeout must be > 0", file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        servers = normalize_endpoints(args.servers or default_servers())
        curve = load_curve_keys(*curve_files(args))
        statuses = query_status(servers, timeout, curve=curve)
    except (ValueError, TypeError, SecurityError) as exc:
        print(f"clone: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except KeyboardInterrupt:
        return 130
    try:
        if args.json:
            emit(json.dumps(statuses, ensure_ascii=False))
        else:
            for line in status_table(statuses):
                emit(line)
    except BrokenPipeError:
        discard_stdout()
        return EXIT_BROKEN_PIPE
    down = [s["endpoint"] for s in statuses if not s["reachable"]]
    for endpoint in down:
        print(f"clone: {endpoint} did not answer within {timeout:g} s", file=sys.stderr)
    return EXIT_UNREACHABLE if down else EXIT_OK


def conflicts(args: argparse.Namespace) -> int:
    """``clone conflicts [--json] [--all]`` and ``clone conflicts apply|discard ID``
    (:mod:`clone.client.conflicts`).  Listing: exit 0, or 2 when a server did
    not answer (the others' are still listed).  Resolving: 0 done, 1 no such
    unresolved conflict, 2 no server answered, 4 refused (``acl``, ``not-active``)."""
    import json

    from clone.argtypes import normalize_endpoints
    from clone.client.conflicts import conflicts_table, query_conflicts, resolve_conflict
    from clone.client.frontend import default_servers, load_curve_keys
    from clone.errors import CloneError, SecurityError

    if (args.action is None) != (args.id is None):
        fail("conflicts apply|discard needs an ID")
        return EXIT_UNREACHABLE
    timeout = args.conflicts_timeout
    if timeout is None:
        timeout = args.timeout if args.timeout_given else STATUS_TIMEOUT
    try:
        servers = normalize_endpoints(args.servers or default_servers())
        curve = load_curve_keys(*curve_files(args))
        found, silent = query_conflicts(
            servers, timeout, everything=args.all or args.action is not None, curve=curve
        )
    except (ValueError, TypeError, SecurityError) as exc:
        fail(str(exc))
        return EXIT_UNREACHABLE
    except KeyboardInterrupt:
        return 130
    for endpoint in silent:
        fail(f"{endpoint} did not answer within {timeout:g} s")
    if args.action is None:
        try:
            if args.json:
                emit(json.dumps(found, ensure_ascii=False))
            else:
                for line in conflicts_table(found):
                    emit(line)
        except BrokenPipeError:
            discard_stdout()
            return EXIT_BROKEN_PIPE
        return EXIT_UNREACHABLE if silent else EXIT_OK
    held = [c for c in found if c.get("id") == args.id and c.get("resolution") is None]
    if not held:
        fail(f"no unresolved conflict {args.id}")
        return EXIT_UNREACHABLE if silent else EXIT_MISSING
    rec = held[0]
    try:
        reply = resolve_conflict(
            rec["server"], args.id, rec["key"], apply=args.action == "apply",
            timeout=timeout, curve=curve,
        )  # fmt: skip
    except (TimeoutError, CloneError) as exc:
        fail(str(exc))
        return EXIT_UNREACHABLE
    if not reply.ok:
        fail(f"{reply.reason}: {reply.detail}")
        return EXIT_MISSING if reply.reason == "unknown-conflict" else EXIT_ERROR
    done = "applied" if args.action == "apply" else "discarded"
    where = f" at sequence {reply.sequence}" if reply.sequence else ""
    emit(f"conflict {args.id} on {rec['key']} {done}{where}")
    return EXIT_OK


#: The commands this module runs, by name.
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "keygen": keygen,
    "backup": backup,
    "status": status,
    "conflicts": conflicts,
}
