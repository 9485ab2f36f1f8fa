"""The CHP server: ``clone-server``.

Holds the sans-IO core (:mod:`.core`: roles, dedup, the passive's sync,
promotion) and the structures it decides with (:mod:`.store`, :mod:`.ttl`,
:mod:`.pending`, :mod:`.snapshot`), the thin tornado/pyzmq reactor that owns the
sockets and timers (:mod:`.reactor` and the modules it is split into by job),
and the command line (:mod:`.cli`).

May import: :mod:`clone.wire`, :mod:`clone.errors`, :mod:`clone.ratelimit`,
:mod:`clone.argtypes` and :mod:`bstar`.  Never the client or the tools.  The
sans-IO modules import no zmq, tornado or ``time``.
"""
