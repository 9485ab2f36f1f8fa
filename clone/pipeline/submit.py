"""The driver script for ``spark-submit``: runs ``clone-pipeline`` with its arguments.

    spark-submit --master URL --py-files clone.zip clone_pipeline_submit.py export ...

``clone-pipeline package --output DIR`` writes this file and ``clone.zip``
(docs/pipeline.md).  Run as ``spark-submit .../clone/pipeline/submit.py``
from an installed package, it works too: its own directory, which Python puts
first on ``sys.path``, is taken off first, or our module names (``errors``,
``session``, ``report``…) would hide top-level modules of those names.
"""

import os
import sys

if __name__ == "__main__":
    _here = os.path.dirname(os.path.abspath(__file__))
    if os.path.basename(_here) == "pipeline":
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

    from clone.pipeline.cli import main

    sys.exit(main())
