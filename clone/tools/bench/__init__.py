"""Benchmarks (``scripts/bench``, ``python -m clone.tools.bench``).

Holds the harness that runs the sections and reports (:mod:`.harness`) and one
module per section.  Results and the targets they are judged by are described
in docs/benchmarks.md.

May import anything in :mod:`clone` and :mod:`clone.tools`; nothing imports it
but its tests.
"""

from clone.tools.bench.harness import (
    SECTIONS,
    TARGETS,
    BenchConfig,
    evaluate_targets,
    machine_info,
    main,
    run_benchmarks,
    summarise_profile,
)

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
