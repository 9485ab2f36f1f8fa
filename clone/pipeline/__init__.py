"""The batch side of Clone: bulk load, export and drill analysis on Spark.

The modules split the way the jobs do:

- :mod:`~clone.pipeline.session` builds the one SparkSession (entry points only);
- :mod:`~clone.pipeline.sources` reads tables, drill logs and exports into
  DataFrames with fixed schemas (the update-event schema is the common ground a
  future journal reader will share);
- :mod:`~clone.pipeline.transforms` holds the pure DataFrame -> DataFrame steps;
- :mod:`~clone.pipeline.snapshot` and :mod:`~clone.pipeline.writer` do the CHP
  I/O (driver-side snapshot, executor-side confirmed writes);
- :mod:`~clone.pipeline.jobs` wires them into ``load``, ``export`` and
  ``drill-report``; :mod:`~clone.pipeline.cli` parses arguments.

Nothing here imports pyspark at module import time except the modules that
need it, and the core :mod:`clone` package never imports this one, so the
service runs without Spark installed.
"""

__all__ = ["DEFAULT_REJECTS", "DEFAULT_MANIFEST"]

# Where ``load`` writes rejected rows unless told (--rejects): under results/,
# the output directory every tool here writes to and .gitignore leaves out, so
# a run in a checkout does not leave an untracked folder at its top.
DEFAULT_REJECTS = "results/clone-pipeline-rejects"
#: What ``load`` confirmed, per partition, for ``load --resume`` (replaced).
DEFAULT_MANIFEST = "results/clone-pipeline-manifest.json"
