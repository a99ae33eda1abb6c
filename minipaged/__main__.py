"""``python -m minipaged ...``: the command line, where the ``minipaged`` script is not on
PATH (a notebook's kernel, for one)."""

import sys

from minipaged.cli import main

sys.exit(main())
