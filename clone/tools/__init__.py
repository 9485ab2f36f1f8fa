"""Operator tools: failover drills, benchmarks and the local pair (``scripts/drill``,
``scripts/bench``, ``scripts/run``).

Nothing in the core :mod:`clone` package imports these (the pipeline's drill
report reads the drill's files, not its code); they may import anything in
:mod:`clone`, and drive real ``clone-server`` and client processes from the
outside.

* :mod:`clone.tools.procs` -- child processes, signals, free ports, logs;
* :mod:`clone.tools.histogram` -- HDR latency histograms;
* :mod:`clone.tools.bench` -- throughput, latency, snapshot and memory benchmarks;
* :mod:`clone.tools.drill` -- failover drills; :mod:`clone.tools.drill.client`
  is the client worker process they start, :mod:`clone.tools.drill.watch`
  watches the server pair, :mod:`clone.tools.drill.analysis` judges the results;
* :mod:`clone.tools.report` -- tables, markdown and plots;
* :mod:`clone.tools.run_pair` -- ``scripts/run``: a local pair, restarted as it dies.
"""
