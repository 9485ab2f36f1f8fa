"""``python -m clone.tools.bench``: run the benchmarks (see :func:`.harness.main`)."""

import sys

from clone.tools.bench.harness import main

sys.exit(main())
