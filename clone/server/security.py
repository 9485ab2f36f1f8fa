"""CURVE, the ZAP handler and the ACL: who may connect, read and write.

How this works: with ``--curve-secret`` the server loads its key pair, the
client certificates of ``--clients`` and the ``--acl`` file (clone.security),
and starts the ZAP handler (:class:`~clone.security.zap.Gatekeeper`) *before*
any socket binds: every socket it binds is then a CURVE server that the
handler guards, and every socket it connects to the peer is a CURVE client
holding the pair's own key (the peer admits it as ``clone/peer``).

The access decisions, each from a connection's ZAP User-Id (a client's
certificate name) and its :class:`~clone.security.acl.Rights`:

* **Writes** (the collector): a KVSET outside the sender's write prefixes, or
  from a name no longer admitted (its certificate was removed and SIGHUP
  reloaded), is refused, counted and answered with a refusal notice on the
  sender's own topic.
* **Snapshots** (the snapshot port): only keys under the requester's read
  prefixes; a restricted requester's KTHXBAI carries its view id and count.
* **The update stream**: the publisher is an XPUB in manual mode, and
  :meth:`Security.subscription_topics` maps what a connection asks for to
  what it may receive, once clone.server.subscribers has checked its caps
  (docs/protocol.md, "Security"); each view of restricted readers gets its own
  heartbeat with the count of updates published in it.

A relay (``--relay``, :mod:`.relaying`) does both sides independently: its
bound sockets are CURVE servers with ``--curve-secret`` exactly as above (its
own key, its own clients directory and ACL), and the sockets it connects to its
upstream are CURVE clients with ``--upstream-curve-secret`` (its own client
key, which the upstream admits by name and judges by *its* ACL) and the
upstream's public key ``--upstream-server-key``.  Either may be absent.

SIGHUP reloads the clients directory and the ACL.  A file that does not load
keeps the old one (logged).  New certificates are admitted at once; if a key
was removed or anyone's read rights changed, the publisher is bound again so
that every subscriber reconnects and its subscriptions are decided afresh
(clients see a short gap and resync): a socket of libzmq has no call to
forget one connection's subscriptions.

Fail closed everywhere: an unknown name, a missing ACL table or a name the
reload removed means no access.

All of it is one part, :class:`Security`, built with the config, the zmq
context, the shared clocks and counters, the :class:`~.access.Access`
settings it installs (the other parts read them) and a way to publish a
notice; ``tests/server/test_security_part.py`` drives it alone.  The server
binds the publisher again when :meth:`Security.reload` says rights shrank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import zmq

from clone.errors import SecurityError
from clone.security import (
    PEER_USER,
    Acl,
    ClientKeys,
    Gatekeeper,
    KeyPair,
    Rights,
    configure_client_socket,
    configure_server_socket,
    fingerprint,
    load_client_keys,
    load_public,
    load_secret,
)
from clone.server.access import Access
from clone.server.config import ServerConfig, ServerMode
from clone.server.shared import Shared
from clone.wire.control import (
    encode_refusal,
    encode_view_heartbeat,
    refusal_topic,
    view_id,
    view_topic,
)

__all__ = ["Security", "subscription_topics"]

log = logging.getLogger("clone.server.reactor")

# Every first byte but NUL: a reader of everything gets keys and HUGZ, never
# another user's control topic.
_ALL_BUT_CONTROL = [bytes([b]) for b in range(1, 256)]


def subscription_topics(topic: bytes, rights: Rights, name: str) -> list[bytes]:
    """What a connection of ``name`` asking for ``topic`` is subscribed to.

    The table of docs/protocol.md, "Security": pure, so that it is tested
    on its own.  Topics starting with NUL are ours to hand out, never asked for.
    """
    if topic[:1] == b"\x00":
        return []
    out: list[bytes]
    if rights.read_all:
        out = list(_ALL_BUT_CONTROL) if not topic else [topic]
    else:
        out = []
        for prefix in rights.read:
            if topic.startswith(prefix):
                out = [topic]
                break
            if prefix.startswith(topic):
                out.append(prefix)
        if not topic:
            out.append(view_topic(view_id(rights.read)))
    if not topic and name != PEER_USER:
        out.append(refusal_topic(name))
    return out


class Security:
    """Keys, the ZAP handler, the ACL and the filtered update stream.

    Without ``--curve-secret`` (and, for a relay, ``--upstream-curve-secret``)
    every key is None and every method lets everything through, as the
    server did before CURVE: :attr:`Access.secure` stays False.
    """

    def __init__(
        self,
        config: ServerConfig,
        ctx: zmq.Context[Any],
        shared: Shared,
        access: Access,
        *,
        publish: Callable[[list[bytes]], None],
    ) -> None:
        self._config = config
        self._ctx = ctx
        self._shared = shared
        self._counters = shared.counters
        self.access = access
        self._publish = publish
        self.keypair: KeyPair | None = None
        self.gatekeeper: Gatekeeper | None = None
        # A relay's CURVE towards its upstream (its own client key pair, the
        # upstream's public key); None: it follows in clear text.
        self.upstream_keypair: KeyPair | None = None
        self.upstream_server_key: bytes | None = None
        self.acl: Acl | None = None
        self.views: dict[str, tuple[bytes, ...]] = {}  # view id -> read prefixes
        self.view_counts: dict[str, int] = {}  # view id -> updates published in it
        self.view_prefixes: list[tuple[str, tuple[bytes, ...]]] = []

    # -- start, reload, stop ---------------------------------------------------

    def open(self) -> None:
        """Load the keys and the ACL and start the ZAP handler (before any bind)."""
        cfg = self._config
        if cfg.mode is ServerMode.RELAY:
            self._open_upstream()
        if cfg.curve_secret is None:
            log.warning(
                "no --curve-secret: anyone who can reach the ports reads and writes every"
                " key, in clear text (docs/operations.md, 'Securing a pair')"
            )
            return
        assert cfg.clients_dir is not None
        keypair = load_secret(cfg.curve_secret)
        if keypair.public == self.upstream_server_key:
            log.warning(
                "--curve-secret is the pair's own certificate: whoever reads this relay's"
                " files can act as a server of the pair; give the relay its own (clone"
                " keygen) and its clients that public key (docs/operations.md, 'Relays')"
            )
        keys = load_client_keys(cfg.clients_dir)
        acl = Acl.load(cfg.acl) if cfg.acl is not None else Acl.allow_all()
        self._report_keys(keys, acl)
        gatekeeper = Gatekeeper(self._ctx, keypair.public, keys, log=log)
        gatekeeper.start()
        self.keypair = keypair
        self.access.secure = True
        self.gatekeeper = gatekeeper
        self._install_acl(keys, acl)
        log.info(
            "CURVE on every socket: %d client certificates from %s; %s",
            len(keys),
            cfg.clients_dir,
            f"ACL {cfg.acl}" if cfg.acl else "no --acl: every admitted client reads and writes all",
        )

    def _open_upstream(self) -> None:
        """A relay's key pair and its upstream's public key, if it follows over CURVE.

        Fail closed: a certificate that does not load stops the relay here,
        before any socket exists, naming the flag and the file.
        """
        cfg = self._config
        if cfg.upstream_curve_secret is None:
            log.warning(
                "no --upstream-curve-secret: following %s in clear text (a CURVE pair"
                " admits no plain relay; docs/operations.md, 'Relays')",
                ", ".join(cfg.upstream),
            )
            return
        assert cfg.upstream_server_key is not None
        try:
            keypair = load_secret(cfg.upstream_curve_secret)
        except SecurityError as exc:
            raise SecurityError(f"--upstream-curve-secret: {exc}") from None
        try:
            server_key = load_public(cfg.upstream_server_key)
        except SecurityError as exc:
            raise SecurityError(f"--upstream-server-key: {exc}") from None
        if keypair.public == server_key:
            log.warning(
                "--upstream-curve-secret is the upstream's own certificate: the upstream"
                " admits this relay as its peer, with every right and no ACL; give the"
                " relay its own client certificate (clone keygen)"
            )
        self.upstream_keypair = keypair
        self.upstream_server_key = server_key
        log.info(
            "CURVE towards the upstream: our key %s (%s), the upstream's %s (%s)",
            fingerprint(keypair.public),
            cfg.upstream_curve_secret,
            fingerprint(server_key),
            cfg.upstream_server_key,
        )

    def close(self) -> None:
        """Stop the ZAP handler: only once every CURVE socket is closed."""
        gatekeeper, self.gatekeeper = self.gatekeeper, None
        if gatekeeper is not None:
            gatekeeper.stop()

    def reload(self) -> bool:
        """SIGHUP: read the clients directory and the ACL again.  Whether the
        publisher must be bound again (a key removed, or read rights changed)."""
        cfg = self._config
        gatekeeper = self.gatekeeper
        if gatekeeper is None:
            log.info("SIGHUP: no --curve-secret, nothing to reload")
            return False
        assert cfg.clients_dir is not None
        try:
            keys = load_client_keys(cfg.clients_dir)
            acl = Acl.load(cfg.acl) if cfg.acl is not None else Acl.allow_all()
        except SecurityError as exc:
            self._counters["security_reload_errors"] += 1
            log.error("SIGHUP: %s; keeping the clients and ACL loaded before", exc)
            return False
        self._report_keys(keys, acl)
        access = self.access
        old_names = set(access.admitted)
        old_rights = {name: access.rights_of(name) for name in old_names}
        gatekeeper.replace_keys(keys)
        self._install_acl(keys, acl)
        removed = old_names - set(access.admitted)
        narrowed = [
            name
            for name in old_names - removed
            if access.rights_of(name).read != old_rights[name].read
        ]
        self._counters["security_reloads"] += 1
        log.warning(
            "SIGHUP: %d client certificates, %s; removed %s, read rights changed for %s",
            len(keys),
            f"ACL {cfg.acl}" if cfg.acl else "no ACL",
            sorted(removed) or "none",
            sorted(narrowed) or "none",
        )
        return bool(removed or narrowed)

    def _report_keys(self, keys: ClientKeys, acl: Acl) -> None:
        for problem in keys.problems:
            log.error("clients directory: %s (that client is not admitted)", problem)
        names = set(keys.names.values())
        for name in sorted(acl.names - names):
            log.warning("ACL table [client.%s] has no certificate in the clients directory", name)

    def _install_acl(self, keys: ClientKeys, acl: Acl) -> None:
        self.acl = acl
        self.access.install({name: acl.rights(name) for name in {*keys.names.values(), PEER_USER}})
        views = {view_id(prefixes): prefixes for prefixes in acl.views()}
        # Keep the counts of views that stay: their subscribers' bases stay valid.
        self.view_counts = {vid: self.view_counts.get(vid, 0) for vid in views}
        self.views = views
        self.view_prefixes = [(vid, prefixes) for vid, prefixes in views.items() if prefixes]

    # -- writes ------------------------------------------------------------------

    def judge(
        self, first: zmq.Frame, frames: list[bytes], *, notify: bool
    ) -> tuple[bool, str | None]:
        """Whether the sender of a KVSET (``first``: its first frame, which
        carries the connection's ZAP User-Id) may write its key, and its name.

        A refusal is counted, logged (rate-limited) and, with ``notify``, told
        to the writer in a refusal notice.
        """
        try:
            user: str | None = str(first.get("User-Id"))
        except zmq.ZMQError:
            user = None
        if self.access.may_write(user, frames):
            return True, user
        self._counters["kvset_refused_acl"] += 1
        self._shared.throttle.log(
            "kvset_acl",
            logging.WARNING,
            "refused a write by %s to %r: not under its write prefixes",
            user,
            frames[0][:80] if frames else b"",
        )
        if notify and len(frames) == 5 and len(frames[2]) in (0, 16):
            self.refusal(user, frames[2], "acl")
        return False, user

    def refusal(self, name: str | None, uuid: bytes, reason: str) -> None:
        """Tell the writer its update was refused (best effort)."""
        if name is None or name == PEER_USER or name not in self.access.admitted:
            return
        self._publish(encode_refusal(name, uuid, reason))

    # -- sockets -------------------------------------------------------------

    def secure(self, sock: zmq.Socket[Any], *, bound: bool) -> None:
        """CURVE for one socket, before it binds (server) or connects to the
        peer (with the pair's key) or, for a relay, to its upstream (with its own)."""
        keypair = self.keypair
        if bound:
            if keypair is not None:
                configure_server_socket(sock, keypair)
            return
        if self._config.mode is ServerMode.RELAY:
            upstream = self.upstream_keypair
            if upstream is not None:
                assert self.upstream_server_key is not None
                configure_client_socket(sock, upstream, self.upstream_server_key)
            return
        if keypair is not None:
            configure_client_socket(sock, keypair, keypair.public)

    def secure_bstar(self, sock: zmq.Socket[Any], bound: bool) -> None:
        self.secure(sock, bound=bound)

    # -- the update stream ---------------------------------------------------

    def subscription_topics(self, frame: zmq.Frame, topic: bytes) -> list[bytes] | None:
        """What a connection asking for ``topic`` gets (the subscription gate's
        question, clone.server.subscribers): in plain mode what it asks; with
        CURVE what its name may read (None: not admitted)."""
        if self.keypair is None:
            return [topic]
        try:
            name: str | None = str(frame.get("User-Id"))
        except zmq.ZMQError:
            name = None
        access = self.access
        if name is None or name not in access.admitted:
            return None
        return subscription_topics(topic, access.rights_of(name), name)

    def count_views(self, updates: list[list[bytes]]) -> None:
        """Count the published updates of each view (for its heartbeat)."""
        counts = self.view_counts
        for vid, prefixes in self.view_prefixes:
            n = 0
            for frames in updates:
                if frames[0].startswith(prefixes):
                    n += 1
            if n:
                counts[vid] += n

    def view_heartbeats(
        self, sequence: int, heartbeat_ms: int, *, stale: bool
    ) -> list[list[bytes]]:
        """Each view's heartbeat: our sequence and the count published in it
        (``stale``: a relay's restricted clients are told as the others)."""
        return [
            encode_view_heartbeat(vid, sequence, heartbeat_ms, count, stale=stale)
            for vid, count in self.view_counts.items()
        ]

    def views_replaced(self) -> None:
        """A relay's copy was replaced without publishing the difference.
        Plain clients see our sequence jump; restricted ones only compare
        counts, so each view's moves on by one: its clients resync."""
        for vid in self.view_counts:
            self.view_counts[vid] += 1
