"""The partition drills' network: each server in a namespace of its own, and the
iptables rules that cut it off.

How this works: :class:`Topology` creates two network namespaces
(``clonedrill-<pid>-primary`` and ``-backup``), each joined by a veth pair to a
bridge in the root namespace, all on a private /24 (``10.213.<k>.0/24``: the
bridge ``.1``, the primary ``.2``, the backup ``.3``).  The servers run inside
their namespaces (``ip netns exec NS clone-server ...``) and bind their
namespace's address; the clients and the drill itself stay in the root
namespace and reach them over the bridge.  Each namespace gets two iptables
chains, ``CLONE-DRILL-IN`` (jumped to from ``INPUT``) and ``CLONE-DRILL-OUT``
(from ``OUTPUT``): a fault appends ``DROP`` rules to them, healing flushes them.
Dropping (not rejecting) is what a partition looks like: no FIN, no RST, the
peer just goes silent.

With ``island=True`` (``partition-split``) a third namespace,
``clonedrill-<pid>-island``, joins the bridge at the next address (``.4``), with
the same chains: a client run inside it has a source address of its own, so a
cut can keep it on one side of a partition and the root namespace's clients on
the other (:meth:`Topology.split`).

Everything carries the drill's pid in its name (namespaces ``clonedrill-<pid>-*``,
links ``cd<pid>*``), so :meth:`Topology.destroy` removes exactly what this run
made, and :func:`remove_leftovers` removes what a run that died without
cleaning up left behind (its pid no longer alive), never another live run's.

Creating namespaces needs root; :func:`preflight` says why it cannot, and
installs iptables (Debian's package) when it is missing and we may.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from clone.tools.procs import pid_alive

__all__ = [
    "ISLAND",
    "NS_PREFIX",
    "NetnsUnavailable",
    "Topology",
    "preflight",
    "remove_leftovers",
]

log = logging.getLogger(__name__)

NS_PREFIX = "clonedrill-"
_LINK_PREFIX = "cd"  # + pid + a letter: within the 15 characters of a link name
#: The namespace for the clients on the isolated side of a partition-split.
ISLAND = "island"
_CHAINS = {"INPUT": "CLONE-DRILL-IN", "OUTPUT": "CLONE-DRILL-OUT"}
_NETS = "10.213"
_NS_RE = re.compile(rf"^{NS_PREFIX}(\d+)-")
_LINK_RE = re.compile(rf"^{_LINK_PREFIX}(\d+)[a-z]+$")


class NetnsUnavailable(RuntimeError):
    """Network namespaces or iptables cannot be used here (not root, no ``ip``,
    no iptables); the message says which and what to do."""


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): "
                           f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _install_iptables() -> bool:
    """Install Debian's iptables, as scripts/test installs Java: root and apt-get only."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return False
    log.warning("installing iptables (apt-get install -y iptables) for the partition drills")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "iptables"]):
        if subprocess.run(argv, capture_output=True, env=env, timeout=600).returncode != 0:
            return False
    return shutil.which("iptables") is not None


def preflight() -> None:
    """Raise :class:`NetnsUnavailable` unless we can create a namespace and run
    iptables inside it (installing iptables first if it is missing and we may)."""
    if shutil.which("ip") is None:
        raise NetnsUnavailable("the partition drills need iproute2's `ip` "
                               "(apt-get install iproute2)")
    if os.geteuid() != 0:
        raise NetnsUnavailable("the partition drills need root: they create network namespaces "
                               "(ip netns add) and iptables rules; run as root")
    if shutil.which("iptables") is None and not _install_iptables():
        raise NetnsUnavailable("the partition drills need iptables and it could not be "
                               "installed (apt-get install iptables)")
    probe = f"{NS_PREFIX}{os.getpid()}-probe"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        raise NetnsUnavailable(f"cannot create a network namespace (ip netns add): "
                               f"{made.stderr.strip()}")
    try:
        rules = _run(["ip", "netns", "exec", probe, "iptables", "-S"], check=False)
        if rules.returncode != 0:
            raise NetnsUnavailable(f"iptables does not work inside a namespace: "
                                   f"{rules.stderr.strip()}")
    finally:
        _run(["ip", "netns", "del", probe], check=False)


def remove_leftovers() -> list[str]:
    """Delete the namespaces and links of drills that died without cleaning up
    (their pid is gone); what was removed."""
    removed = []
    names = _run(["ip", "netns", "list"], check=False).stdout.split("\n")
    for line in names:
        name = line.split(" ")[0]
        m = _NS_RE.match(name)
        if m and not pid_alive(int(m[1])):
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    links = _run(["ip", "-o", "link", "show"], check=False).stdout
    for line in links.splitlines():
        parts = line.split(":")
        if len(parts) < 2:
            continue
        link = parts[1].strip().split("@")[0]
        m = _LINK_RE.match(link)
        if m and not pid_alive(int(m[1])):
            _run(["ip", "link", "del", link], check=False)
            removed.append(link)
    if removed:
        log.warning("removed leftovers of an earlier drill: %s", ", ".join(removed))
    return removed


def _used_subnets() -> str:
    """Every IPv4 address and route on this host, as ``ip`` prints them."""
    used = _run(["ip", "-4", "-o", "addr", "show"], check=False).stdout
    return used + _run(["ip", "-4", "route", "show"], check=False).stdout


def _claim_subnet(pid: int, lock_dir: Path | None = None) -> tuple[str, int]:
    """``10.213.<k>`` not used by any address or route on this host, and the
    open descriptor of the lock that holds it for this run.

    Drills run at once (parallel test workers, two operators): each looked for
    a free /24 and only later added its addresses, so two could pick the same
    one.  The lock (``flock`` on ``<tmp>/clone-drill-subnets/<k>.lock``) is taken
    before the addresses are read again: a subnet is this run's until
    :meth:`Topology.destroy` closes the descriptor, or until the run dies (the
    kernel drops the lock, and :func:`remove_leftovers` its links).
    """
    locks = lock_dir or Path(tempfile.gettempdir()) / "clone-drill-subnets"
    locks.mkdir(mode=0o700, exist_ok=True)
    used = _used_subnets()
    for i in range(256):
        k = (pid + i) % 256
        prefix = f"{_NETS}.{k}"
        if f"{prefix}." in used:
            continue
        fd = os.open(locks / f"{k}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        if f"{prefix}." in _used_subnets():  # taken between the two reads
            os.close(fd)
            continue
        return prefix, fd
    raise RuntimeError(f"no free /24 under {_NETS}.0.0/16")


@dataclass
class Topology:
    """Two server namespaces (and an island for clients) on a bridge; see the
    module's docstring."""

    servers: tuple[str, ...] = ("primary", "backup")
    island: bool = False  # a third namespace, for clients on the isolated side
    pid: int = field(default_factory=os.getpid)
    subnet: str = ""  # "10.213.<k>", chosen at create()
    created: list[str] = field(default_factory=list)  # what destroy() removes, in order made
    cuts: list[str] = field(default_factory=list)  # the rules in force, for the record
    #: The lock that holds :attr:`subnet` for this run (-1: none held).
    subnet_lock: int = -1

    @property
    def bridge(self) -> str:
        return f"{_LINK_PREFIX}{self.pid}br"

    @property
    def host_address(self) -> str:
        """The root namespace's address on the bridge (the clients' source address)."""
        return f"{self.subnet}.1"

    @property
    def spaces(self) -> tuple[str, ...]:
        """Every namespace this topology makes, by its short name."""
        return (*self.servers, ISLAND) if self.island else self.servers

    def namespace(self, server: str) -> str:
        return f"{NS_PREFIX}{self.pid}-{server}"

    def address(self, server: str) -> str:
        return f"{self.subnet}.{2 + self.spaces.index(server)}"

    def _veth(self, server: str) -> str:
        return f"{_LINK_PREFIX}{self.pid}{server[0]}"

    def prefix(self, server: str) -> list[str]:
        """The argv prefix that runs a command inside ``server``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(server)]

    def _in(self, server: str, *argv: str) -> None:
        _run([*self.prefix(server), *argv])

    def create(self) -> None:
        """Make the namespaces, veths, bridge and chains; on a failure, remove
        what was made and raise."""
        remove_leftovers()
        self.subnet, self.subnet_lock = _claim_subnet(self.pid)
        try:
            _run(["ip", "link", "add", self.bridge, "type", "bridge"])
            self.created.append(f"link:{self.bridge}")
            _run(["ip", "addr", "add", f"{self.host_address}/24", "dev", self.bridge])
            _run(["ip", "link", "set", self.bridge, "up"])
            for server in self.spaces:
                ns, veth = self.namespace(server), self._veth(server)
                _run(["ip", "netns", "add", ns])
                self.created.append(f"netns:{ns}")
                _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth}x"])
                self.created.append(f"link:{veth}")
                _run(["ip", "link", "set", f"{veth}x", "netns", ns])
                _run(["ip", "link", "set", veth, "master", self.bridge, "up"])
                self._in(server, "ip", "link", "set", f"{veth}x", "name", "eth0")
                self._in(server, "ip", "addr", "add", f"{self.address(server)}/24", "dev", "eth0")
                self._in(server, "ip", "link", "set", "eth0", "up")
                self._in(server, "ip", "link", "set", "lo", "up")
                for hook, chain in _CHAINS.items():
                    self._in(server, "iptables", "-N", chain)
                    self._in(server, "iptables", "-I", hook, "-j", chain)
        except BaseException:
            self.destroy()
            raise

    def destroy(self) -> None:
        """Remove the rules, namespaces, veths and bridge this run made; never raises."""
        for item in reversed(self.created):
            kind, name = item.split(":", 1)
            try:
                if kind == "netns":
                    server = name.rsplit("-", 1)[1]
                    for hook, chain in _CHAINS.items():
                        _run([*self.prefix(server), "iptables", "-D", hook, "-j", chain], False)
                        _run([*self.prefix(server), "iptables", "-F", chain], False)
                        _run([*self.prefix(server), "iptables", "-X", chain], False)
                    _run(["ip", "netns", "del", name], check=False)
                else:
                    # Deleting one end of a veth deletes both; gone already is fine.
                    _run(["ip", "link", "del", name], check=False)
            except Exception:  # cleanup goes on with the rest
                log.exception("could not remove %s", item)
        self.created.clear()
        self.cuts.clear()
        if self.subnet_lock >= 0:  # last: the subnet's addresses are gone
            os.close(self.subnet_lock)
            self.subnet_lock = -1

    # -- faults ---------------------------------------------------------------

    def _drop(self, server: str, hook: str, *match: str) -> None:
        self._in(server, "iptables", "-A", _CHAINS[hook], *match, "-j", "DROP")
        self.cuts.append(f"{self.namespace(server)} {_CHAINS[hook]} {' '.join(match)} DROP")

    def cut_pair_link(self, ha_ports: dict[str, int]) -> None:
        """Drop the Binary Star traffic between the servers, both ways, in both
        namespaces: each server's HA publisher port, as seen from either end.
        Everything else (the clients, the passive's subscription to the active's
        updates) still flows."""
        for server in self.servers:
            for peer in self.servers:
                if peer == server:
                    continue
                mine, theirs = str(ha_ports[server]), str(ha_ports[peer])
                addr = self.address(peer)
                for port_match in (("--dport", mine), ("--sport", theirs)):
                    self._drop(server, "INPUT", "-s", addr, "-p", "tcp", *port_match)
                for port_match in (("--sport", mine), ("--dport", theirs)):
                    self._drop(server, "OUTPUT", "-d", addr, "-p", "tcp", *port_match)

    def isolate(self, server: str) -> None:
        """Drop everything between ``server`` and the rest of the subnet: its peer,
        the clients, the drill (its loopback still works)."""
        net, me = f"{self.subnet}.0/24", self.address(server)
        for chain in _CHAINS.values():  # its own address, over loopback, still works
            self._in(server, "iptables", "-A", chain, "-s", me, "-d", me, "-j", "RETURN")
        self._drop(server, "INPUT", "-s", net)
        self._drop(server, "OUTPUT", "-d", net)

    def split(self, server: str, peer: str, reset: bool = False) -> None:
        """A split brain's network (``partition-split``): ``server`` is cut from
        everything but the island (its peer, the root namespace's clients, the
        drill), and the island from ``peer``.  The island's clients then reach
        ``server`` only, the root namespace's clients ``peer`` only.

        The island and ``peer`` drop each other's packets on arrival (``INPUT`` on
        both ends), not on departure: a packet dropped in its sender's ``OUTPUT``
        fails locally, and Linux then retries every 0.5 s without backing off,
        which no lost packet on a real network causes.  Dropped on arrival, the
        senders back off as they would behind a broken switch.

        With ``reset``, the island's TCP to ``peer`` is refused with a RST
        instead (``REJECT --reject-with tcp-reset`` as it leaves the island):
        its open connections to ``peer`` break at their next packet, as with
        a restarted peer or an expired NAT entry, and cannot be made again
        until the heal."""
        if not self.island:
            raise ValueError("split() needs a topology made with island=True")
        net, me, island = f"{self.subnet}.0/24", self.address(server), self.address(ISLAND)
        for chain in _CHAINS.values():  # its own address, over loopback, still works
            self._in(server, "iptables", "-A", chain, "-s", me, "-d", me, "-j", "RETURN")
        self._keep(server, "INPUT", "-s", island)
        self._keep(server, "OUTPUT", "-d", island)
        self._drop(server, "INPUT", "-s", net)
        self._drop(server, "OUTPUT", "-d", net)
        if reset:
            rule = ("-d", self.address(peer), "-p", "tcp", "-j", "REJECT",
                    "--reject-with", "tcp-reset")
            self._in(ISLAND, "iptables", "-A", _CHAINS["OUTPUT"], *rule)
            self.cuts.append(f"{self.namespace(ISLAND)} {_CHAINS['OUTPUT']} {' '.join(rule)}")
            # The RST that REJECT makes comes into the island "from" ``peer``:
            # dropped by the rule below, it never reached the socket, which
            # then retried each refused segment locally every 0.5 s and
            # delivered them all at the heal, as through a silent cut.
            self._keep(ISLAND, "INPUT", "-s", self.address(peer), "-p", "tcp",
                       "--tcp-flags", "RST", "RST")
        self._drop(ISLAND, "INPUT", "-s", self.address(peer))
        self._drop(peer, "INPUT", "-s", island)

    def _keep(self, server: str, hook: str, *match: str) -> None:
        self._in(server, "iptables", "-A", _CHAINS[hook], *match, "-j", "RETURN")
        self.cuts.append(f"{self.namespace(server)} {_CHAINS[hook]} {' '.join(match)} RETURN")

    def heal(self) -> None:
        """Flush every drill chain: the network is whole again."""
        for server in self.spaces:
            for chain in _CHAINS.values():
                self._in(server, "iptables", "-F", chain)
        self.cuts.clear()

    def rules(self, server: str) -> str:
        """``iptables -S`` inside ``server``'s namespace (for the record)."""
        return _run([*self.prefix(server), "iptables", "-S"], check=False).stdout
