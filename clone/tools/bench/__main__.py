"""``python -m clone.tools.bench``: run the benchmarks (see :func:`.cli.main`)."""

import sys

from clone.tools.bench.cli import main

sys.exit(main())
