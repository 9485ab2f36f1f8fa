"""``clone``: read, write and watch a Clone server pair from the shell.

Argument parsing and printing only; the work is :class:`clone.Clone`.  The
subcommands live one group per module in :mod:`clone.client.commands` (a new
group is one ``register(sub, common)`` call in :func:`_parser`); the
connection flags are accepted before or after the subcommand.  Exit codes
(docs/client.md has the table):
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
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from clone.client.commands import admin, kv, leases, lock
from clone.client.commands.output import (
    EXIT_BROKEN_PIPE,
    EXIT_CONFLICT,
    EXIT_ERROR,
    EXIT_MISSING,
    EXIT_OK,
    EXIT_UNCONFIRMED,
    EXIT_UNREACHABLE,
    discard_stdout,
    emit,
    fail,
    json_line,
    plain_line,
    waiting,
)
from clone.layered import add_config_flags, parse_layered

log = logging.getLogger(__name__)

# The client library (zmq, the agent) is imported by the commands that
# connect, not here: `clone --help` and usage errors need none of it.
if TYPE_CHECKING:
    from clone.client.frontend import Clone

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_CONFLICT",
    "EXIT_ERROR",
    "EXIT_MISSING",
    "EXIT_OK",
    "EXIT_UNCONFIRMED",
    "EXIT_UNREACHABLE",
    "main",
]

#: The connection settings (the options before COMMAND) are also ``CLONE_<OPTION>``
#: ($CLONE_SERVERS, $CLONE_CURVE_SECRET, $CLONE_SERVER_KEY, ...) and keys of ``--config``.
ENV_PREFIX = "CLONE_"
KILL_GRACE = lock.KILL_GRACE
#: For the tests of `clone lock`'s argument handling.
_lock_command = lock.lock_command


#: Commands that take the connection flags after their name too, and their own
#: ``--json``/``--timeout`` where they have one (so the common one is left out).
_OWN_TIMEOUT = ("backup", "status")


def _connection_flags(p: argparse.ArgumentParser, *, after: bool, timeout: bool = True) -> None:
    """The options every command shares.  ``after``: the copy a subcommand takes,
    which sets nothing unless given (argparse.SUPPRESS), so a flag before the
    subcommand is not reset by the subcommand's default."""
    keep: dict[str, Any] = {"default": argparse.SUPPRESS} if after else {}
    p.add_argument(
        "--servers",
        help="comma-separated CHP base endpoints, [tcp://]host:port, in failover order "
        "(default: $CLONE_SERVERS, else tcp://127.0.0.1:5556,tcp://127.0.0.1:5566)",
        **keep,
    )
    p.add_argument(
        "--subtree",
        action="append",
        metavar="PREFIX",
        help="only sync this subtree, e.g. /config/ (repeatable)",
        **keep,
    )
    if timeout:
        p.add_argument(
            "--timeout",
            type=float,
            metavar="S",
            help="seconds to wait for a snapshot and for a write's confirmation (default 5)",
            **(keep or {"default": 5.0}),
        )
    p.add_argument(
        "--heartbeat",
        type=float,
        metavar="S",
        help="heartbeat to assume of servers that do not advertise theirs (the Guide's), "
        "in seconds; failover after 2.5 of them (default 1). Ours advertise theirs",
        **(keep or {"default": 1.0}),
    )
    p.add_argument(
        "--curve-secret",
        metavar="FILE",
        help="this client's secret certificate (NAME.key_secret, from `clone keygen`): "
        "connect with CURVE (default: $CLONE_CURVE_SECRET); needs --server-key",
        **keep,
    )
    p.add_argument(
        "--server-key",
        metavar="FILE",
        help="the server pair's public certificate (default: $CLONE_SERVER_KEY); "
        "needs --curve-secret",
        **keep,
    )
    p.add_argument(
        "-v", "--verbose", action="store_true", help="log what the client does", **keep
    )
    p.add_argument(
        "--json", action="store_true", help="print JSON (one object per line)", **keep
    )
    if after:
        p.add_argument(
            "-w", "--write-out", choices=("simple", "json"), default=argparse.SUPPRESS,
            help="output format, as etcdctl's: -w json is --json",
        )  # fmt: skip


def _common(*, timeout: bool = True) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("connection (also accepted before COMMAND)")
    _connection_flags(group, after=True, timeout=timeout)  # type: ignore[arg-type]
    return common


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="clone",
        description="Read, write and watch keys held by a Clone server pair.",
    )
    _connection_flags(p, after=False)
    add_config_flags(p, env_prefix=ENV_PREFIX)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common, no_timeout = _common(), _common(timeout=False)

    # One registration per command group (clone.client.commands).
    kv.register(sub, common)
    leases.register(sub, common)

    lock.register(sub, common)

    dump = sub.add_parser(
        "dump", parents=[common], help="print every key under PREFIX as key=value"
    )
    dump.add_argument("prefix", nargs="?", default="")

    watch = sub.add_parser(
        "watch", parents=[common], help="print changes under PREFIX until interrupted"
    )
    watch.add_argument("prefix", nargs="?", default="")
    watch.add_argument(
        "--duration", type=float, default=None, metavar="S", help="stop after S seconds"
    )
    watch.add_argument(
        "--since",
        type=kv.sequence,
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
        parents=[no_timeout],
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
        parents=[no_timeout],
        help="print every server's role, sequence, keys, peer state, uptime and version "
        "(exit 2 if any server does not answer)",
    )
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
        parents=[no_timeout],
        help="list the split-brain conflicts the servers keep (writes of a stepped-down"
        " server not applied), or apply or discard one",
    )
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


# A snapshot still arriving is waited for past --timeout, up to this long.
_SYNC_CAP_S = 600.0


def _wait_synced(client: Clone, timeout: float) -> None:
    """Wait for the snapshot.  ``timeout`` bounds the wait for a server to
    answer; a snapshot that is arriving -- the agent syncing from one server,
    neither asking again nor failing over, which it does when that server falls
    silent -- is waited for to its end, up to ``_SYNC_CAP_S``: a million keys
    take more than the 5 s default on a busy machine."""
    from clone.errors import NotSynced

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

    if args.verbose or sys.stderr.isatty():
        with waiting("sync", args.timeout, sync_status):
            _wait_synced(client, args.timeout)
    else:  # nothing would show: spare a script the import of the progress bar (rich)
        _wait_synced(client, args.timeout)
    handler: Callable[[argparse.Namespace, Clone], int] | None = getattr(args, "handler", None)
    if handler is not None:
        return handler(args, client)
    if args.command == "dump":
        # Page by page: a 10M-key listing held whole cost ~12 GB beside the replica.
        for entry in client.iter_entries(args.prefix):
            emit(json_line(entry) if args.json else plain_line(entry))
    elif args.command == "watch":
        return _watch(args, client)
    return EXIT_OK


def _watch(args: argparse.Namespace, client: Clone) -> int:
    """Print changes until interrupted, ``--duration`` or the reader of our
    output going away: a closed pipe is noticed within a heartbeat even when
    no change comes (``clone watch | grep -m1 ...`` must not wait for one)."""
    changes = client.changes(timeout=args.duration, prefix=args.prefix, since=args.since)
    gone = threading.Event()
    threading.Thread(
        target=_watch_reader, args=(changes.close, gone, args.heartbeat), daemon=True,
        name="clone-watch-stdout",
    ).start()  # fmt: skip
    try:
        for entry in changes:
            emit(json_line(entry) if args.json else plain_line(entry))
    except KeyboardInterrupt:
        pass
    finally:
        changes.close()
    if gone.is_set():
        raise BrokenPipeError("the reader of our output went away")
    return EXIT_OK


def _watch_reader(stop: Callable[[], None], gone: threading.Event, every: float) -> None:
    """Poll stdout for an error or hang-up (the read end of our pipe closed)."""
    import select

    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # no real file (replaced in-process): nothing to watch
        return
    poller = select.poll()
    poller.register(fd, 0)  # POLLERR and POLLHUP are always reported
    while True:
        if poller.poll(max(10, round(every * 500))):
            gone.set()
            stop()
            return


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``clone`` console script."""
    # The CURVE pair comes from one layer, so a flag never mixes with a stale variable.
    parser = _parser()
    layered = parse_layered(
        parser, argv, env_prefix=ENV_PREFIX, together=[("curve-secret", "server-key")]
    )
    args = layered.args
    args.timeout_given = layered.given("timeout")
    if getattr(args, "write_out", None) == "json":
        args.json = True
    if args.print_config:
        emit(layered.render("clone connection settings"))
        return EXIT_OK
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.ERROR,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.timeout <= 0 or args.heartbeat <= 0:
        fail("--timeout and --heartbeat must be > 0")
        return EXIT_UNREACHABLE
    if args.command in admin.COMMANDS:
        return admin.COMMANDS[args.command](args)
    if args.command == "lock":
        args.cmd = lock.lock_command(args)  # before connecting: a usage error exits 2 at once
    usage = kv.check(args) or leases.check(args)
    if usage is not None:  # before connecting, as argparse's own: exit 2
        fail(usage)
        return EXIT_UNREACHABLE
    from clone.argtypes import normalize_endpoints
    from clone.client.frontend import Clone, default_servers
    from clone.errors import CloneError, ConfirmTimeout, NotSynced, SecurityError

    try:
        servers = normalize_endpoints(args.servers or default_servers())
        secret, server_key = admin.curve_files(args)
        args.curve_secret_in_use = secret
        client = Clone(
            servers,
            args.subtree,
            heartbeat=args.heartbeat,
            curve_secret=secret,
            server_key=server_key,
        )
    except (ValueError, TypeError, SecurityError) as exc:
        fail(str(exc))
        return EXIT_UNREACHABLE
    try:
        return _run(args, client)
    except BrokenPipeError:
        discard_stdout()
        return EXIT_BROKEN_PIPE
    except NotSynced as exc:
        _close_uninterrupted(client)  # its sockets off before the probe's
        fail(_why_not_synced(args, servers, exc))
        return EXIT_UNREACHABLE
    except ConfirmTimeout as exc:
        fail(str(exc))
        return EXIT_UNCONFIRMED
    except OSError as exc:  # --file, --output
        fail(str(exc))
        return EXIT_ERROR
    except (CloneError, ValueError, TypeError) as exc:
        fail(str(exc))
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_OK if args.command in ("watch", "elect") else 130
    finally:
        _close_uninterrupted(client)


def _why_not_synced(args: argparse.Namespace, servers: list[str], exc: Exception) -> str:
    """The NotSynced message, with the cause a probe of each server finds
    (clone.client.commands.diagnose): a refused key, only a passive, nothing
    listening.  Without one (an active answered late), the message alone."""
    from clone.client.commands.diagnose import explain
    from clone.client.frontend import load_curve_keys

    try:
        cause = explain(servers, min(args.timeout, 1.0), load_curve_keys(*admin.curve_files(args)))
    except Exception as probe_failed:  # a diagnosis must never hide the error itself
        logging.getLogger(__name__).info("could not probe the servers: %s", probe_failed)
        cause = None
    return f"{cause} ({exc})" if cause else str(exc)


def _close_uninterrupted(client: Clone) -> None:
    """Close the client even if a second Ctrl-C arrives while it shuts down.

    SIGINT is ignored for the close only and put back as it was, also when
    the close raises: a program that calls :func:`main` in-process keeps its
    Ctrl-C, and so do the children it starts later (an ignored signal is
    inherited across ``exec``).  A handler that Python did not install (an
    embedding C program's: ``getsignal`` gives None) could not be put back
    from Python, so then the close is left interruptible instead."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        client.close()
        return
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        client.close()
    finally:
        signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
