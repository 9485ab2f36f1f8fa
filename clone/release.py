"""This release of Clone: one constant, read by the code rather than the installed metadata.

Why not ``importlib.metadata``: a checkout run with its own root first on the
path (a drill, a test, a server started by one) reports the version of whatever
distribution is installed in the environment, not of the code that runs.  This
module imports nothing, so every package (storage included) may read it; a test
checks it against setup.cfg's ``version``.
"""

from __future__ import annotations

__all__ = ["RELEASE"]

#: The release this code is (setup.cfg's ``version``).
RELEASE = "0.2.0"
