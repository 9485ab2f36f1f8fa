"""Benchmarks of a real clone-server, next to the ceilings of ZeroMQ on this machine.

How this works: every measurement moves CHP-shaped traffic (five-frame KVSETs
with 100-byte values) from a *writer* process to one or more *watcher*
processes through a *target*:

* ``clone``: a real ``clone-server --standalone`` (KVSET in its collector, KVPUB
  out of its publisher);
* ``c-proxy``: libzmq's own ``zmq.proxy(XSUB, XPUB)`` in its own process, the
  ceiling of what ZeroMQ can forward here;
* ``py-forwarder``: a trivial pyzmq SUB -> PUB ``recv_multipart``/``send_multipart``
  loop in its own process, the ceiling of a Python process doing nothing else.

Writer and watchers run in separate processes (``multiprocessing``, spawn), so
the load generator and the target do not share a GIL.  With more than one
subscriber, ``probes`` of them (default 1) are measuring Python watchers and the
rest are C-level sinks (``zmq.proxy`` from a SUB into a PUB with no peers, one
thread each, in one process): the target pays for every subscriber, but ten
Python watchers would saturate two cores by themselves and measure the watchers,
not the target.  Before any clock starts,
the writer builds every message and sends *warm-up* messages until each watcher
has seen one (subscriptions propagate asynchronously, so without this the first
messages would be dropped by PUB).  Then:

* **throughput**: the writer sends N messages as fast as it can; each watcher
  counts what it receives and when the last one arrived.  Rate per subscriber =
  received / (last arrival - writer's first send).
* **latency**: the writer sends on a fixed schedule; each message carries its
  *intended* send time (CLOCK_MONOTONIC, shared by all processes on Linux) and a
  watcher records ``arrival - intended`` in an HDR histogram.  Measuring from the
  intended time, not from the actual send, means a stall in the writer or the
  server delays the messages queued behind it and is counted for each of them:
  no coordinated omission.
* **snapshot**: load N keys into a fresh server, then time a raw ICANHAZ? until
  KTHXBAI (serve time, completeness checked) and a real ``clone.Clone`` client
  until ``wait_synced`` returns (sync time), while a watcher process records
  every HUGZ, so the largest heartbeat gap during the snapshot is known.
* **memory**: server RSS before and after loading N keys (psutil).

``--profile DIR`` runs ``py-spy record`` on the server during each section and
reports the functions where it spent its time.  ``scripts/bench`` and
``python -m clone.tools.bench`` run them (:func:`.cli.main`).

Modules: the configuration (:mod:`.config`), the command line (:mod:`.cli`),
one run of the sections (:mod:`.run`), one module per section
(:mod:`.throughput`, :mod:`.latency`, :mod:`.snapshot`, :mod:`.memory`,
:mod:`.durability`, :mod:`.security`, :mod:`.subscribers`, :mod:`.calls`), the
targets and one traffic run through them (:mod:`.targets`), the processes
that write and watch (:mod:`.processes`), py-spy profiles (:mod:`.profiling`),
and the machine info and targets judged in the results (:mod:`.results`).
Results and the targets they are judged by are described in docs/benchmarks.md.

May import anything in :mod:`clone` and :mod:`clone.tools`; nothing imports it
but its tests and the drill (which loads keys with :func:`.targets.load_keys`).
"""

from clone.tools.bench.cli import main
from clone.tools.bench.config import SECTIONS, TARGETS, BenchConfig
from clone.tools.bench.profiling import summarise_profile
from clone.tools.bench.results import evaluate_targets, machine_info
from clone.tools.bench.run import run_benchmarks

__all__ = [
    "SECTIONS",
    "TARGETS",
    "BenchConfig",
    "evaluate_targets",
    "machine_info",
    "main",
    "run_benchmarks",
    "summarise_profile",
]
