"""A bytecode cache for the test run, when the environment turns it off.

With ``PYTHONDONTWRITEBYTECODE`` set (some CI and sandbox environments set
it), every Python process compiles every module of ours from source: each of
the suite's hundreds of ``clone-server`` starts, each console script a test
runs, and each xdist worker's collection.  Measured on the 2-core machine: a
server's start-up took 0.29 s of CPU instead of 0.22, and collecting the
suite 8.5 s instead of 3.5 (per worker).

So when writing bytecode is off, :func:`enable` keeps it off *in the source
tree*, as asked, and writes it under ``PYTHONPYCACHEPREFIX`` instead (Python's
own mirror tree, outside the checkout: ``<tmp>/clone-tests-pycache-<uid>``,
kept between runs), for this process and, through the environment, for every
process the tests start.  A prefix the environment already gives is kept.
Without ``PYTHONDONTWRITEBYTECODE`` nothing changes: Python's ``__pycache__``
directories, as always.
"""

from __future__ import annotations

import os
import sys
import tempfile

__all__ = ["enable"]

_OFF = "PYTHONDONTWRITEBYTECODE"
_PREFIX = "PYTHONPYCACHEPREFIX"


def enable() -> str | None:
    """Turn the cache on under a prefix if the environment turned it off;
    the prefix used, or None when nothing was changed."""
    if not os.environ.get(_OFF) and not sys.dont_write_bytecode:
        return None
    prefix = os.environ.get(_PREFIX) or os.path.join(
        tempfile.gettempdir(), f"clone-tests-pycache-{os.getuid()}"
    )
    os.environ.pop(_OFF, None)
    os.environ[_PREFIX] = prefix
    sys.pycache_prefix = prefix
    sys.dont_write_bytecode = False
    return prefix
