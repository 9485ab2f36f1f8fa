"""The CHP wire format and our extensions of it.

Holds: the protocol constants and limits (:mod:`.protocol`), the codec of the
Guide's messages (:mod:`.codec`), our KVBATCH (:mod:`.batch`) and KVAPPLIED
(:mod:`.applied`) extensions, and the pyzmq hot-path send/receive helpers
(:mod:`.frames`).  Pure, sans-IO modules but ``frames``, the one place that
knows pyzmq's fast paths.

May import: :mod:`clone.errors`, the standard library, ``uuid6`` and (``frames``
only) ``zmq``.  Nothing here imports the client, the server or the tools.
"""
