"""``python -m kvsieve.cli``."""

import sys

from kvsieve.cli import main

sys.exit(main())
