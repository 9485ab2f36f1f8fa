"""``python -m clone.pipeline``: the ``clone-pipeline`` command."""

import sys

from clone.pipeline.cli import main

sys.exit(main())
