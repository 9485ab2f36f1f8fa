"""``python -m clone.tools.drill``: run one drill (see :func:`.harness.main`)."""

import sys

from clone.tools.drill.harness import main

sys.exit(main())
