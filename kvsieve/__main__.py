"""``python -m kvsieve``: the command line."""

import sys

from kvsieve.cli import main

sys.exit(main())
