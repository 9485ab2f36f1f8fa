"""What an application hands :class:`bstar.reactor.BinaryStar`: its hooks' types.

Why a module of its own: these are the contract between Binary Star and the
server that embeds it (the role callbacks, the socket setup for its security,
the vote handlers, the rank of its data), read by whoever writes that server,
apart from how the reactor carries them out.  Re-exported by
:mod:`bstar.reactor` and the package.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import zmq
from zmq.eventloop.zmqstream import ZMQStream

from bstar.fsm import Rank

__all__ = ["RankSource", "SocketSetup", "StateCallback", "VoteHandler"]

#: Called with no arguments when the server becomes active, passive, or detects
#: split brain.
StateCallback = Callable[[], object]
#: Called with a socket before it binds (True) or connects (False): see BinaryStar.
SocketSetup = Callable[[zmq.Socket[Any], bool], object]
#: Called with the voter stream and the received frames when a vote is accepted;
#: reply on the stream if the protocol needs a reply.
VoteHandler = Callable[[ZMQStream, list[bytes]], object]
#: Returns how new the application's data is now: ``(term, sequence)``.
RankSource = Callable[[], Rank]
