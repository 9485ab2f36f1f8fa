import sys

from clone.tools.chaos.cli import main

sys.exit(main())
