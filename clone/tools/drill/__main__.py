"""``python -m clone.tools.drill``: run one drill (see :func:`.cli.main`)."""

import sys

from clone.tools.drill.cli import main

sys.exit(main())
