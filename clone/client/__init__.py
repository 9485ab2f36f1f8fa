"""The client: the ``Clone`` frontend, its agent thread, and the ``clone`` command.

Holds the frontend that application threads call (:mod:`.frontend`: the
writes and calls, over the reads of :mod:`.reads` and the threads and
lifecycle of :mod:`.handle`), the agent thread that owns the sockets
(:mod:`.agent`), the agent's sans-IO state machine
(:mod:`.fsm`: its inputs and table, over :mod:`.state`, with the rules of a sync
in :mod:`.sync`, of failing over in :mod:`.failover`, of writes in
:mod:`.writes` and of calls and lease keepalives in :mod:`.calls`), the
application's lease handle (:mod:`.leases`), and the command line
(:mod:`.cli`).  The frontend's parts: argument checks and JSON values
(:mod:`.args`), the command pipe to the agent (:mod:`.pipe`), the event
dispatcher, waiters and callbacks (:mod:`.events`), calls and leases
(:mod:`.calling`), and the default client of ``clone_set``/``clone_get``
(:mod:`.default`).  The public API is re-exported by :mod:`clone` itself (``from
clone import Clone, clone_set, clone_get``).

May import: :mod:`clone.wire`, :mod:`clone.errors`, :mod:`clone.ratelimit`,
:mod:`clone.argtypes` and :mod:`clone.security` (certificates and CURVE socket
setup, for ``curve_secret``/``server_key``).  Never the server or the tools.
"""
