"""Chaos runs (``scripts/drill --scenario chaos``): random, combined faults
against a server pair under recorded traffic, and a checker of every guarantee
the docs promise, run on the saved history.

The seeded fault plan (:mod:`.schedule`, pure), the recording client processes
(:mod:`.worker`), the faults carried out (:mod:`.faults`), the run
(:mod:`.runner`), the checker (:mod:`.checker`, pure), and the verdict, figures
and timeline picture (:mod:`.report`; ``python -m clone.tools.chaos.check DIR``
judges a saved history again).  docs/drills.md, "Chaos", describes them.
"""
