"""``scripts/drill --scenario hostile``: attacks on a pair's memory,
descriptors and loop, measured.

:mod:`.attacks` holds each attack (a process of its own), :mod:`.harness` runs
one against a fresh pair and measures it, :mod:`.cli` runs them in turn and
prints a line per attack.  docs/drills.md, "Hostile clients".
"""
