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
    "MAX_TTL_SECONDS",
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
# on every KVPUB/KVSYNC of an ephemeral key so both servers agree on it.
EXPIRES_PROPERTY: Final = "expires"

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

# The Guide's example pair on one host.
DEFAULT_PRIMARY_PORT: Final = 5556
DEFAULT_BACKUP_PORT: Final = 5566
DEFAULT_PRIMARY_HA_PORT: Final = 5003
DEFAULT_BACKUP_HA_PORT: Final = 5004
