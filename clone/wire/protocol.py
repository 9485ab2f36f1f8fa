"""CHP constants: commands, port offsets and the limits we enforce.

Every number a peer could trip over lives here, so ``docs/protocol.md`` and the
code cannot drift apart silently.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "ICANHAZ",
    "KTHXBAI",
    "HUGZ",
    "SNAPSHOT_OFFSET",
    "PUBLISHER_OFFSET",
    "COLLECTOR_OFFSET",
    "MAX_KEY_BYTES",
    "MAX_VALUE_BYTES",
    "MAX_PROPERTIES_BYTES",
    "MAX_SUBTREE_BYTES",
    "TTL_PROPERTY",
    "EXPIRES_PROPERTY",
    "TTL_LEFT_PROPERTY",
    "TTL_LEFT_METADATA",
    "TTL_LEFT_NAME",
    "TTL_LEFT_VERSION",
    "MAX_TTL_SECONDS",
    "HEARTBEAT_PROPERTY",
    "MAX_HEARTBEAT_MS",
    "STALE_PROPERTY",
    "DEFAULT_HEARTBEAT_MS",
    "DEFAULT_MISSED_HEARTBEATS",
    "DEFAULT_PRIMARY_PORT",
    "DEFAULT_BACKUP_PORT",
    "DEFAULT_PRIMARY_HA_PORT",
    "DEFAULT_BACKUP_HA_PORT",
    "KVBATCH",
    "BATCH_PROPERTY",
    "BATCH_VERSION",
    "BATCH_METADATA",
    "MAX_BATCH_ENTRIES",
    "BATCH_TARGET_BYTES",
    "MAX_BATCH_BYTES",
    "KVAPPLIED",
    "APPLIED_PROPERTY",
    "APPLIED_VERSION",
    "APPLIED_METADATA",
    "STEPPED_DOWN_PROPERTY",
    "STEPPED_DOWN_METADATA",
    "REQUESTER_PROPERTY",
    "REQUESTER_ID_CHARS",
    "MAX_APPLIED_IDS",
    "KVDELTA",
    "SINCE_PROPERTY",
    "SINCE_TERM_PROPERTY",
    "SINCE_DIGEST_BYTES",
    "CONTROL_PREFIX",
    "VIEW_TAG",
    "REFUSAL_TAG",
    "VIEW_PROPERTY",
    "VIEW_COUNT_PROPERTY",
    "REASON_PROPERTY",
    "REFUSAL_REASONS",
    "VIEW_ID_CHARS",
    "STATUS_REQUEST",
    "STATUS_REPLY",
    "MAX_STATUS_BYTES",
]

# Command words as they appear in frame 0.
ICANHAZ: Final = b"ICANHAZ?"
KTHXBAI: Final = b"KTHXBAI"
HUGZ: Final = b"HUGZ"

# A server at base port P opens SNAPSHOT (ROUTER) at P, PUBLISHER (PUB) at
# P+1 and COLLECTOR (SUB) at P+2.
SNAPSHOT_OFFSET: Final = 0
PUBLISHER_OFFSET: Final = 1
COLLECTOR_OFFSET: Final = 2

# Limits.  Clone is a configuration store: a key is a path, a value a document.
MAX_KEY_BYTES: Final = 1024
MAX_VALUE_BYTES: Final = 1024 * 1024
MAX_PROPERTIES_BYTES: Final = 4096
MAX_SUBTREE_BYTES: Final = MAX_KEY_BYTES
# A ttl longer than a year is almost certainly a unit mistake (ms for s).
MAX_TTL_SECONDS: Final = 365 * 24 * 3600.0

# Properties with meaning to the server.
TTL_PROPERTY: Final = "ttl"
# Extension (ours): absolute expiry in Unix seconds, set by the active server
# on every KVPUB of an ephemeral key, for display: no server expires a key by it.
EXPIRES_PROPERTY: Final = "expires"
# Extension (ours): the seconds an ephemeral key has left, appended as the last
# property of a snapshot or catch-up entry, only for a requester that set the
# metadata below on its snapshot DEALER (our servers' sync); the receiver removes
# it before storing and counts it from when it received it.
TTL_LEFT_PROPERTY: Final = "ttl-left"
TTL_LEFT_NAME: Final = "X-CHP-TTL-Left"
TTL_LEFT_VERSION: Final = "1"
TTL_LEFT_METADATA: Final = f"{TTL_LEFT_NAME}:{TTL_LEFT_VERSION}".encode()

# Extension (ours): a HUGZ says the server's heartbeat interval, in whole
# milliseconds, so clients judge its silence by its own rhythm.
HEARTBEAT_PROPERTY: Final = "heartbeat"
MAX_HEARTBEAT_MS: Final = 3_600_000
# Extension (ours): a relay's HUGZ says ``stale=1`` while it has lost the pair
# it relays: it still serves its last state, which may be behind.
STALE_PROPERTY: Final = "stale"

# Liveness defaults (docs/operations.md, "Heartbeats and failure detection").
# A HUGZ and a Binary Star state message every 250 ms; a server or peer silent
# for 4 of them (1 s) is presumed dead.  The Guide uses 1 s and 2 missed: a
# freeze then costs 2.5 s before anyone acts; 250 ms x 4 notices it in 1 s and
# still rides out a 750 ms stall, for 4 small messages a second per subscriber.
DEFAULT_HEARTBEAT_MS: Final = 250
DEFAULT_MISSED_HEARTBEATS: Final = 4

# Extension (ours): batched snapshots, docs/protocol.md "KVBATCH".  A requester
# that sets this ZMTP metadata property on its snapshot DEALER may get its
# KVSYNCs packed into KVBATCH messages; one that does not (the Guide's clients)
# gets the standard stream.  The value is the version it understands.
KVBATCH: Final = b"KVBATCH"
BATCH_PROPERTY: Final = "X-CHP-Batch"
BATCH_VERSION: Final = "1"
BATCH_METADATA: Final = f"{BATCH_PROPERTY}:{BATCH_VERSION}".encode()
# Entries per KVBATCH: the length columns stay 16 KiB each, and one batch is a
# few milliseconds of work for either end, so neither reactor stalls on one.
MAX_BATCH_ENTRIES: Final = 4096
# A sender stops adding entries once the keys, properties and bodies in the
# batch reach this many bytes (a batch always has at least one entry) ...
BATCH_TARGET_BYTES: Final = 1024 * 1024
# ... so they never add up to more than this, which receivers enforce.
MAX_BATCH_BYTES: Final = BATCH_TARGET_BYTES + MAX_KEY_BYTES + MAX_PROPERTIES_BYTES + MAX_VALUE_BYTES

# Extension (ours): the applied-update list, docs/protocol.md "KVAPPLIED".  A
# passive server asks for it (this ZMTP metadata on its sync DEALER) so that it
# can tell which of the client updates it holds pending the active server has
# already applied: those are in (or superseded in) the snapshot and must never
# be applied again at a promotion (docs/failover.md, "Pending updates").
KVAPPLIED: Final = b"KVAPPLIED"
APPLIED_PROPERTY: Final = "X-CHP-Applied"
APPLIED_VERSION: Final = "1"
APPLIED_METADATA: Final = f"{APPLIED_PROPERTY}:{APPLIED_VERSION}".encode()
#: [extension] On a peer's sync request: it stepped down from active in this
#: run (a split brain's loser), so it has writes of its term to forward, and
#: the winner holds client snapshots until they are in (clone.server.healing).
#: A restarted peer, with nothing of this run to forward, does not say it.
STEPPED_DOWN_PROPERTY: Final = "X-CHP-Stepped-Down"
STEPPED_DOWN_METADATA: Final = f"{STEPPED_DOWN_PROPERTY}:1".encode()
#: [extension] On a client's snapshot DEALER: the client's name for itself, a
#: random id per agent, the same on every fresh socket it asks on.  A new
#: request from the same requester replaces its older stream (or waiting
#: request) instead of taking another slot (clone.wire.requester).
REQUESTER_PROPERTY: Final = "X-CHP-Requester"
#: Its value: this many lowercase hex characters (64 random bits).
REQUESTER_ID_CHARS: Final = 16
# Update ids (16-byte uuids) per KVAPPLIED message: 64 KiB of ids.
MAX_APPLIED_IDS: Final = 4096

# The Guide's example pair on one host.
DEFAULT_PRIMARY_PORT: Final = 5556
DEFAULT_BACKUP_PORT: Final = 5566
DEFAULT_PRIMARY_HA_PORT: Final = 5003
DEFAULT_BACKUP_HA_PORT: Final = 5004

# Extension (ours): catch-up from a sequence, docs/protocol.md "KVDELTA".  A
# server restarted with its state on disk sets this ZMTP metadata on its sync
# DEALER ("<sequence>,<digest in hex>" of its last update); an active server
# whose history still reaches back that far, and agrees on that update, sends
# only the updates after it, announced by a KVDELTA, instead of a snapshot.
KVDELTA: Final = b"KVDELTA"
SINCE_PROPERTY: Final = "X-CHP-Since"
# Beside it, a pair server's catch-up also says the term its last update was
# written under (decimal).  The digest alone cannot tell a fork in which both
# servers published the same client write at the same sequence after
# different updates (a promoted backup's pending list); the term can.  A
# server that does not know this property ignores it (and checks the digest).
SINCE_TERM_PROPERTY: Final = "X-CHP-Since-Term"
# Bytes of an update's digest (blake2b), 16 hex characters in the metadata.
SINCE_DIGEST_BYTES: Final = 8

# Extension (ours): control topics, docs/protocol.md "Security: CURVE, ACLs and
# filtered streams".  A key may not begin with NUL: topics that do carry the
# server's notices to one client, on the update stream, where the server (an
# XPUB_MANUAL socket) alone decides who is subscribed to them.
CONTROL_PREFIX: Final = b"\x00"
# A view heartbeat, ``\x00V<view id>\x00``: the heartbeat of a restricted
# client's filtered stream, with how many updates the view has had.
VIEW_TAG: Final = b"\x00V"
# A refusal notice, ``\x00R<client name>\x00``: a write of that client refused.
REFUSAL_TAG: Final = b"\x00R"
# KTHXBAI (restricted requester) and view heartbeat properties.
VIEW_PROPERTY: Final = "view"
VIEW_COUNT_PROPERTY: Final = "view_count"
# Refusal notice property, and the reasons a server may give (a relay adds
# ``stale``: it has lost the pair; ``overloaded``: its queue to the pair is full).
REASON_PROPERTY: Final = "reason"
REFUSAL_REASONS: Final = frozenset({"acl", "full", "size", "stale", "overloaded", "conflict"})
# A view id: this many hex characters of a SHA-256 (48 bits: views are few).
VIEW_ID_CHARS: Final = 12

# Extension (ours): a server's status, docs/protocol.md "STATUS?".  A one-frame
# request on the snapshot port, answered at once with one JSON object.  It is
# not a Binary Star vote: a passive server answers it too.  Guide peers never
# send it.
STATUS_REQUEST: Final = b"STATUS?"
STATUS_REPLY: Final = b"STATUS"
# The reply's JSON body, in bytes: a status is a few hundred.
MAX_STATUS_BYTES: Final = 64 * 1024
