"""Failover drills (``scripts/drill``, ``python -m clone.tools.drill``).

Holds the harness that runs a pair, clients and one scenario (:mod:`.harness`),
the client worker process it starts (:mod:`.client`), the watcher of the pair's
HUGZ and stats (:mod:`.watch`), and the pure judgement of the results
(:mod:`.analysis`).  docs/drills.md describes scenarios and guarantees.

May import anything in :mod:`clone` and :mod:`clone.tools`; nothing imports it
but its tests and the pipeline's drill report.
"""

from clone.tools.drill.analysis import analyse, percentile
from clone.tools.drill.harness import SCENARIOS, DrillConfig, main, run_drill

__all__ = ["SCENARIOS", "DrillConfig", "analyse", "main", "percentile", "run_drill"]
