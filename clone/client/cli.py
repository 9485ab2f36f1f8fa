"""``clone``: read, write and watch a Clone server pair from the shell.

Argument parsing and printing only; the work is :class:`clone.Clone`.  Exit codes:
0 success, 1 key not found, 2 no server answered (or bad usage; for ``clone
status``: any server did not answer), 3 a write was not confirmed in time, 4 any
other Clone error, 5 a compare-and-set conflict (``--if-seq``) or a lock not
acquired within ``--wait`` (``clone lock`` otherwise exits with its command's
code, 128 + N if a signal N killed it), 141 the reader of our output went away
(``clone dump | head``): 128 + SIGPIPE, what a shell reports for ``cat`` in the
same place, quietly, so ``set -o pipefail`` scripts see that the output was cut
short.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence

from clone.argtypes import normalize_endpoints
from clone.client.frontend import (
    Clone,
    Entry,
    default_curve_files,
    default_servers,
    load_curve_keys,
)
from clone.client.locked import (
    DEFAULT_KILL_GRACE,
    FORWARDED_SIGNALS,
    LOCK_TOKEN_ENV,
    LockedCommand,
)
from clone.errors import CloneError, ConfirmTimeout, Conflict, NotSynced, SecurityError
from clone.layered import add_config_flags, parse_layered
from clone.progress import Progress
from clone.recipes import Lock

log = logging.getLogger(__name__)

__all__ = ["main"]

EXIT_OK, EXIT_MISSING, EXIT_UNREACHABLE, EXIT_UNCONFIRMED, EXIT_ERROR = 0, 1, 2, 3, 4
EXIT_CONFLICT = 5
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # 141

#: The connection settings (the options before COMMAND) are also ``CLONE_<OPTION>``
#: ($CLONE_SERVERS, $CLONE_CURVE_SECRET, $CLONE_SERVER_KEY, ...) and keys of ``--config``.
ENV_PREFIX = "CLONE_"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="clone",
        description="Read, write and watch keys held by a Clone server pair.",
    )
    p.add_argument(
        "--servers",
        help="comma-separated CHP base endpoints, [tcp://]host:port, in failover order "
        "(default: $CLONE_SERVERS, else tcp://127.0.0.1:5556,tcp://127.0.0.1:5566)",
    )
    p.add_argument(
        "--subtree",
        action="append",
        metavar="PREFIX",
        help="only sync this subtree, e.g. /config/ (repeatable)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds to wait for a server to answer a snapshot request (one that is "
        "arriving is waited for to its end) and for a write's confirmation (default 5)",
    )
    p.add_argument(
        "--heartbeat",
        type=float,
        default=1.0,
        metavar="S",
        help="heartbeat to assume of servers that do not advertise theirs (the Guide's), "
        "in seconds; failover after 2.5 of them (default 1). Ours advertise theirs",
    )
    p.add_argument(
        "--curve-secret",
        metavar="FILE",
        help="this client's secret certificate (NAME.key_secret, from `clone keygen`): "
        "connect with CURVE (default: $CLONE_CURVE_SECRET); needs --server-key",
    )
    p.add_argument(
        "--server-key",
        metavar="FILE",
        help="the server pair's public certificate (default: $CLONE_SERVER_KEY); "
        "needs --curve-secret",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log what the client does")
    add_config_flags(p, env_prefix=ENV_PREFIX)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    get = sub.add_parser("get", help="print a key's value (exit 1 if absent)")
    get.add_argument("key")

    set_ = sub.add_parser("set", help="write a key and wait until the server confirms it")
    set_.add_argument("key")
    set_.add_argument("value")
    set_.add_argument("--ttl", type=float, default=0, metavar="SECONDS", help="expire after")
    set_.add_argument(
        "--if-seq",
        type=_sequence,
        default=None,
        metavar="N",
        help="write only if the key is at sequence N (0: only if absent); exit 5 with"
        " the key's current sequence otherwise",
    )

    delete = sub.add_parser("del", help="delete a key (confirmed)")
    delete.add_argument("key")
    delete.add_argument(
        "--if-seq", type=_sequence, default=None, metavar="N", help="as for set"
    )

    lock = sub.add_parser(
        "lock",
        help="run COMMAND while holding the lock NAME (like `etcdctl lock`)",
        description="Take the lock NAME (a key prefix, e.g. /locks/backup), run COMMAND,"
        " release the lock, and exit with COMMAND's code. Waiters get the lock in"
        " arrival order; a holder that dies frees it after --ttl. If the lock's lease"
        " is lost while COMMAND runs, COMMAND is sent SIGTERM (SIGKILL after --kill-grace)"
        " and clone exits 4. COMMAND runs in its own process group and dies with clone;"
        " SIGTERM, SIGINT and SIGHUP are passed on to it; a COMMAND killed by signal N"
        f" gives 128+N. ${LOCK_TOKEN_ENV} holds the lock's fencing token.",
    )
    lock.add_argument("name")
    lock.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    _lock_options(lock)

    dump = sub.add_parser("dump", help="print every key under PREFIX as key=value")
    dump.add_argument("prefix", nargs="?", default="")
    dump.add_argument("--json", action="store_true", help="one JSON object per line")

    watch = sub.add_parser("watch", help="print changes under PREFIX until interrupted")
    watch.add_argument("prefix", nargs="?", default="")
    watch.add_argument("--json", action="store_true", help="one JSON object per line")
    watch.add_argument(
        "--duration", type=float, default=None, metavar="S", help="stop after S seconds"
    )
    watch.add_argument(
        "--since",
        type=_sequence,
        default=None,
        metavar="N",
        help="first print every change after sequence N from the active server's history, "
        "then the live ones (exit 4 if the history no longer reaches back to N)",
    )

    keygen = sub.add_parser(
        "keygen",
        help="write a CURVE key pair: DIR/NAME.key (public, for the server's clients "
        "directory) and DIR/NAME.key_secret (secret, mode 0600, for --curve-secret)",
    )
    keygen.add_argument("name", metavar="NAME", help="the client's name (the file stem)")
    keygen.add_argument(
        "--dir", required=True, metavar="DIR", help="where to write (created 0700 if missing)"
    )

    backup = sub.add_parser(
        "backup",
        help="write a consistent copy of the active server's state to FILE, "
        "for clone-server --restore",
    )
    backup.add_argument("file", metavar="FILE", help="the state file to write (replaced whole)")
    backup.add_argument(
        "--timeout",
        dest="backup_timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds the whole backup may take, failovers included "
        "(default: the global --timeout if given, else 10)",
    )
    status = sub.add_parser(
        "status",
        help="print every server's role, sequence, keys, peer state, uptime and version "
        "(exit 2 if any server does not answer)",
    )
    status.add_argument("--json", action="store_true", help="a JSON list, one object per server")
    status.add_argument(
        "--timeout",
        dest="status_timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds to wait for the answers, all servers at once "
        "(default: the global --timeout if given, else 2)",
    )
    conflicts = sub.add_parser(
        "conflicts",
        help="list the split-brain conflicts the servers keep (writes of a stepped-down"
        " server not applied), or apply or discard one",
    )
    conflicts.add_argument("--json", action="store_true", help="a JSON list, one per conflict")
    conflicts.add_argument(
        "--all", action="store_true", help="resolved ones too (default: unresolved only)"
    )
    conflicts.add_argument(
        "--timeout",
        dest="conflicts_timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds to wait for the servers (default: the global --timeout if given, else 2)",
    )
    conflicts.add_argument(
        "action",
        nargs="?",
        choices=("apply", "discard"),
        help="apply: write the stepped-down server's value now; discard: keep the current one",
    )
    conflicts.add_argument("id", nargs="?", type=int, metavar="ID", help="the conflict's id")
    return p


def _text(value: bytes) -> str:
    """One printable line: invalid UTF-8 and control characters as escapes."""
    text = value.decode("utf-8", "backslashreplace")
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _json_line(entry: Entry) -> str:
    obj: dict[str, object] = {"key": entry.key}
    if entry.value is None:
        obj["value"] = None
        obj["deleted"] = True
    else:
        try:
            obj["value"] = entry.value.decode("utf-8")
        except UnicodeDecodeError:
            obj["value"] = base64.b64encode(entry.value).decode("ascii")
            obj["base64"] = True
    obj["sequence"] = entry.sequence
    obj["properties"] = dict(entry.properties)
    return json.dumps(obj, ensure_ascii=False)


def _plain_line(entry: Entry) -> str:
    if entry.value is None:
        return f"{entry.key} (deleted)"
    return f"{entry.key}={_text(entry.value)}"


def _sequence(text: str) -> int:
    """A sequence number argument: a whole number in 0..2**64-1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a sequence number") from None
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"{value} is not a sequence number (0..2**64-1)")
    return value


def _emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _waiting(what: str, timeout: float, status: Callable[[], str] | None = None) -> Progress:
    """The progress of a wait of up to ``timeout`` s: on a terminal, a bar of
    the time spent (drawn only after a second, gone at the end); elsewhere an
    INFO line every few seconds, shown with --verbose.  The agent's status does
    not count a snapshot's keys before it is complete, so time is what we show."""
    started = time.monotonic()

    def poll(bar: Progress) -> None:
        bar.update(min(time.monotonic() - started, timeout),
                   status=status() if status is not None else None)

    return Progress(what, timeout, unit="s", rate=False, poll=poll, poll_every=0.2,
                    show_after=1.0, transient=True)


# A snapshot still arriving is waited for past --timeout, up to this long.
_SYNC_CAP_S = 600.0


def _wait_synced(client: Clone, timeout: float) -> None:
    """Wait for the snapshot.  ``timeout`` bounds the wait for a server to
    answer; a snapshot that is arriving -- the agent syncing from one server,
    neither asking again nor failing over, which it does when that server falls
    silent -- is waited for to its end, up to ``_SYNC_CAP_S``: a million keys
    take more than the 5 s default on a busy machine (issue 29)."""
    deadline = time.monotonic() + timeout
    cap = deadline + _SYNC_CAP_S
    seen: tuple[str | None, int, int] | None = None
    while True:
        left = deadline - time.monotonic()
        try:
            client.wait_synced(max(0.05, min(left, 1.0)))
            return
        except NotSynced:
            now = client.status()
            moving = (now.server, now.counters.get("retries", 0), now.failovers)
            # Unchanged since the last look (or a first look: one more round).
            arriving = (
                now.state == "syncing" and now.server is not None and seen in (None, moving)
            )
            seen = moving
            if time.monotonic() < deadline:
                continue
            if not arriving or time.monotonic() >= cap:
                tried = ", ".join(now.servers) or "no servers configured"
                raise NotSynced(
                    f"no server answered a snapshot request within {timeout:g} s: "
                    f"tried {tried}"
                ) from None
            log.debug("snapshot from %s still arriving after %g s", now.server, timeout)


def _run(args: argparse.Namespace, client: Clone) -> int:
    def sync_status() -> str:
        now = client.status()
        return f"{now.state} from {now.server}" if now.server else now.state

    with _waiting("sync", args.timeout, sync_status):
        _wait_synced(client, args.timeout)
    if args.command == "get":
        value = client.get(args.key)
        if value is None:
            print(f"clone: key {args.key!r} not found", file=sys.stderr)
            return EXIT_MISSING
        sys.stdout.buffer.write(value + b"\n")
        sys.stdout.flush()
    elif args.command in ("set", "del"):
        try:
            if args.command == "set":
                client.set(
                    args.key,
                    args.value,
                    args.ttl,
                    wait=True,
                    timeout=args.timeout,
                    if_sequence=args.if_seq,
                )
            else:
                client.delete(args.key, wait=True, timeout=args.timeout, if_sequence=args.if_seq)
        except Conflict as exc:
            print(f"clone: {exc}", file=sys.stderr)
            print(exc.current)
            return EXIT_CONFLICT
    elif args.command == "lock":
        return _lock(args, client)
    elif args.command == "dump":
        for entry in client.entries(args.prefix):
            _emit(_json_line(entry) if args.json else _plain_line(entry))
    elif args.command == "watch":
        try:
            changes = client.changes(timeout=args.duration, prefix=args.prefix, since=args.since)
            for entry in changes:
                _emit(_json_line(entry) if args.json else _plain_line(entry))
        except KeyboardInterrupt:
            pass
    return EXIT_OK


def _lock_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ttl", type=float, default=5.0, metavar="S", help="the lock's lease ttl (default 5)"
    )
    parser.add_argument(
        "--wait",
        type=float,
        default=None,
        metavar="S",
        help="give up (exit 5) if the lock is not ours within S seconds (default: wait)",
    )
    parser.add_argument(
        "--kill-grace",
        type=float,
        default=DEFAULT_KILL_GRACE,
        metavar="S",
        help="if the lock is lost, SIGKILL the command S seconds after its SIGTERM"
        f" (default {DEFAULT_KILL_GRACE:g})",
    )


def _lock_command(args: argparse.Namespace) -> list[str]:
    """The command of ``clone lock``, once ``--ttl``/``--wait`` are read.

    REMAINDER takes every word after NAME, so the documented ``clone lock NAME
    --ttl 5 -- COMMAND`` hands us the options too: the words before ``--`` are
    ours when they start with an option (a command never does; without ``--``
    the command's words are refused as unknown options, exit 2).
    """
    command = list(args.cmd)
    if command and command[0] != "--" and command[0].startswith("-"):
        split = command.index("--") if "--" in command else len(command)
        options = argparse.ArgumentParser(prog="clone lock NAME", add_help=False)
        _lock_options(options)
        options.parse_args(command[:split], namespace=args)
        command = command[split:]
    if command[:1] == ["--"]:
        command = command[1:]
    return command


class _Stopped(Exception):
    """A forwarded signal arrived while we waited for the lock: leave the queue."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _lock(args: argparse.Namespace, client: Clone) -> int:
    """``clone lock NAME -- COMMAND``: the command runs only while we hold the lock
    (clone.client.locked says how it is kept from outliving it)."""
    command = list(args.cmd)
    if not command:
        print("clone: lock needs a command: clone lock NAME -- COMMAND ...", file=sys.stderr)
        return EXIT_UNREACHABLE
    if args.kill_grace < 0:
        print("clone: --kill-grace must be >= 0", file=sys.stderr)
        return EXIT_UNREACHABLE
    lock = Lock(client, args.name, ttl=args.ttl)
    running: list[LockedCommand] = []

    def on_signal(signum: int, frame: object) -> None:
        # Before the command runs: leave the queue; after: the command's.
        if not running:
            raise _Stopped(signum)
        running[0].signal_group(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in FORWARDED_SIGNALS}
    try:
        runner: LockedCommand | None = None
        try:
            if not lock.acquire(timeout=args.wait):
                print(
                    f"clone: lock {args.name!r} not acquired within {args.wait:g} s",
                    file=sys.stderr,
                )
                return EXIT_CONFLICT
            env = dict(os.environ)
            env[LOCK_TOKEN_ENV] = str(lock.token)
            runner = LockedCommand(command, env, kill_grace=args.kill_grace)
            try:
                runner.start()
            except OSError as exc:
                print(f"clone: cannot run {command[0]!r}: {exc}", file=sys.stderr)
                return EXIT_ERROR
            running.append(runner)
        except _Stopped as stopped:
            if runner is None or runner.pid is None:
                return 128 + stopped.signum
            running.append(runner)  # it started just before the signal: pass it on
            runner.signal_group(stopped.signum)
        while True:
            status = runner.wait(0.1)
            if status is not None:
                return status
            if not lock.held:
                print(
                    f"clone: lost the lock {args.name!r} (its lease ran out); stopping the"
                    f" command (SIGTERM, SIGKILL after {args.kill_grace:g} s)",
                    file=sys.stderr,
                )
                runner.stop()
                return EXIT_ERROR
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for started in running:
            started.close()
        lock.release()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``clone`` console script."""
    # The CURVE pair comes from one layer, so a flag never mixes with a stale variable.
    layered = parse_layered(
        _parser(), argv, env_prefix=ENV_PREFIX, together=[("curve-secret", "server-key")]
    )
    args = layered.args
    args.timeout_given = layered.given("timeout")
    if args.print_config:
        _emit(layered.render("clone connection settings"))
        return EXIT_OK
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.ERROR,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.timeout <= 0 or args.heartbeat <= 0:
        print("clone: --timeout and --heartbeat must be > 0", file=sys.stderr)
        return EXIT_UNREACHABLE
    if args.command == "keygen":
        return _keygen(args)
    if args.command == "backup":
        return _backup(args)
    if args.command == "status":
        return _status(args)
    if args.command == "conflicts":
        return _conflicts(args)
    if args.command == "lock":
        args.cmd = _lock_command(args)  # before connecting: a usage error exits 2 at once
    try:
        servers = normalize_endpoints(args.servers or default_servers())
        secret, server_key = _curve_files(args)
        client = Clone(
            servers,
            args.subtree,
            heartbeat=args.heartbeat,
            curve_secret=secret,
            server_key=server_key,
        )
    except (ValueError, TypeError, SecurityError) as exc:
        print(f"clone: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        return _run(args, client)
    except BrokenPipeError:
        _discard_stdout()
        return EXIT_BROKEN_PIPE
    except NotSynced as exc:
        print(f"clone: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except ConfirmTimeout as exc:
        print(f"clone: {exc}", file=sys.stderr)
        return EXIT_UNCONFIRMED
    except (CloneError, ValueError, TypeError) as exc:
        print(f"clone: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_OK if args.command == "watch" else 130
    finally:
        _close_uninterrupted(client)


def _curve_files(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """The pair as resolved from one layer (flags, environment, file); the
    library's own reading of the environment when the namespace has none (a
    caller that built it with the bare parser)."""
    if args.curve_secret is not None or args.server_key is not None:
        return args.curve_secret, args.server_key
    return default_curve_files()


def _keygen(args: argparse.Namespace) -> int:
    """``clone keygen --dir DIR NAME``: :func:`clone.security.keygen`."""
    from clone.security import fingerprint, keygen, load_public

    try:
        public, secret = keygen(args.dir, args.name)
        # What the server logs for this key, to tell it apart from others there.
        print_ = fingerprint(load_public(public))
    except SecurityError as exc:
        print(f"clone: {exc}", file=sys.stderr)
        return EXIT_ERROR
    _emit(str(public))
    _emit(str(secret))
    _emit(f"fingerprint {print_}")
    return EXIT_OK


BACKUP_TIMEOUT = 10.0


def _backup(args: argparse.Namespace) -> int:
    """``clone backup FILE``: its own sockets (:mod:`clone.client.backup`), not a
    :class:`Clone`, which keeps decoded values rather than the frames a
    restored server must serve byte for byte."""
    from clone.client.backup import check_writable, take_backup, write_backup

    timeout = args.backup_timeout
    if timeout is None:
        timeout = args.timeout if args.timeout_given else BACKUP_TIMEOUT
    if not timeout > 0:
        print("clone: --timeout must be > 0", file=sys.stderr)
        return EXIT_UNREACHABLE
    start = time.monotonic()
    try:
        servers = normalize_endpoints(args.servers or default_servers())
        curve = load_curve_keys(*_curve_files(args))
        check_writable(args.file)
        with _waiting("backup", timeout):
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
    _emit(
        f"wrote {len(copy.entries)} keys at sequence {copy.sequence} to {args.file} "
        f"in {elapsed:.2f} s"
    )
    return EXIT_OK


STATUS_TIMEOUT = 2.0


def _status(args: argparse.Namespace) -> int:
    """``clone status [--json]``: STATUS? to every server (:mod:`clone.client.status`).

    Exit 0 when every server answered, 2 when any did not (each is still
    reported, as unreachable), like ``etcdctl endpoint status``.
    """
    from clone.client.status import query_status, status_table

    timeout = args.status_timeout
    if timeout is None:
        timeout = args.timeout if args.timeout_given else STATUS_TIMEOUT
    if not timeout > 0:
        print("clone: --timeout must be > 0", file=sys.stderr)
        return EXIT_UNREACHABLE
    try:
        servers = normalize_endpoints(args.servers or default_servers())
        curve = load_curve_keys(*_curve_files(args))
        statuses = query_status(servers, timeout, curve=curve)
    except (ValueError, TypeError, SecurityError) as exc:
        print(f"clone: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except KeyboardInterrupt:
        return 130
    try:
        if args.json:
            _emit(json.dumps(statuses, ensure_ascii=False))
        else:
            for line in status_table(statuses):
                _emit(line)
    except BrokenPipeError:
        _discard_stdout()
        return EXIT_BROKEN_PIPE
    down = [s["endpoint"] for s in statuses if not s["reachable"]]
    for endpoint in down:
        print(f"clone: {endpoint} did not answer within {timeout:g} s", file=sys.stderr)
    return EXIT_UNREACHABLE if down else EXIT_OK


def _conflicts(args: argparse.Namespace) -> int:
    """``clone conflicts [--json] [--all]`` and ``clone conflicts apply|discard ID``
    (:mod:`clone.client.conflicts`).  Listing: exit 0, or 2 when a server did
    not answer (the others' are still listed).  Resolving: 0 done, 1 no such
    unresolved conflict, 2 no server answered, 4 refused (``acl``, ``not-active``)."""
    from clone.client.conflicts import conflicts_table, query_conflicts, resolve_conflict

    if (args.action is None) != (args.id is None):
        print("clone: conflicts apply|discard needs an ID", file=sys.stderr)
        return EXIT_UNREACHABLE
    timeout = args.conflicts_timeout
    if timeout is None:
        timeout = args.timeout if args.timeout_given else STATUS_TIMEOUT
    try:
        servers = normalize_endpoints(args.servers or default_servers())
        curve = load_curve_keys(*_curve_files(args))
        found, silent = query_conflicts(
            servers, timeout, everything=args.all or args.action is not None, curve=curve
        )
    except (ValueError, TypeError, SecurityError) as exc:
        print(f"clone: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except KeyboardInterrupt:
        return 130
    for endpoint in silent:
        print(f"clone: {endpoint} did not answer within {timeout:g} s", file=sys.stderr)
    if args.action is None:
        try:
            if args.json:
                _emit(json.dumps(found, ensure_ascii=False))
            else:
                for line in conflicts_table(found):
                    _emit(line)
        except BrokenPipeError:
            _discard_stdout()
            return EXIT_BROKEN_PIPE
        return EXIT_UNREACHABLE if silent else EXIT_OK
    held = [c for c in found if c.get("id") == args.id and c.get("resolution") is None]
    if not held:
        print(f"clone: no unresolved conflict {args.id}", file=sys.stderr)
        return EXIT_UNREACHABLE if silent else EXIT_MISSING
    rec = held[0]
    try:
        reply = resolve_conflict(
            rec["server"], args.id, rec["key"], apply=args.action == "apply",
            timeout=timeout, curve=curve,
        )  # fmt: skip
    except (TimeoutError, CloneError) as exc:
        print(f"clone: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    if not reply.ok:
        print(f"clone: {reply.reason}: {reply.detail}", file=sys.stderr)
        return EXIT_MISSING if reply.reason == "unknown-conflict" else EXIT_ERROR
    done = "applied" if args.action == "apply" else "discarded"
    where = f" at sequence {reply.sequence}" if reply.sequence else ""
    _emit(f"conflict {args.id} on {rec['key']} {done}{where}")
    return EXIT_OK


def _discard_stdout() -> None:
    """Point stdout at /dev/null: the reader is gone, and without this the
    interpreter's final flush of what is still buffered fails again and prints
    "Exception ignored ... BrokenPipeError" on the way out."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real file descriptor (stdout replaced in-process)
        pass
    finally:
        os.close(devnull)


def _close_uninterrupted(client: Clone) -> None:
    """Close the client even if a second Ctrl-C arrives while it shuts down."""
    if threading.current_thread() is not threading.main_thread():
        client.close()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        client.close()
    finally:
        signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
