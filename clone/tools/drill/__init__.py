"""Failover drills (``scripts/drill``, ``python -m clone.tools.drill``).

Holds the configuration and scenarios (:mod:`.config`), the command line
(:mod:`.cli`), the run's timeline (:mod:`.harness`) over the pair and client
processes it starts (:mod:`.pair`), the scenarios' fault plans
(:mod:`.scenarios`), the clients' event files (:mod:`.events`), the verdict
(:mod:`.checks`), the client worker process (:mod:`.client`), the watcher of
the pair's HUGZ and stats (:mod:`.watch`), and the pure judgement of the
results (:mod:`.analysis`).  docs/drills.md describes scenarios and guarantees.

May import anything in :mod:`clone` and :mod:`clone.tools`; nothing imports it
but its tests and the pipeline's drill report.
"""

from clone.tools.drill.analysis import analyse, percentile
from clone.tools.drill.cli import main
from clone.tools.drill.config import SCENARIOS, DrillConfig
from clone.tools.drill.harness import run_drill

__all__ = ["SCENARIOS", "DrillConfig", "analyse", "main", "percentile", "run_drill"]
