"""``python -m tabserve.bench``: the TabICLv2 benchmark driver (see :mod:`tabserve.bench.cli`)."""

import sys

from .cli import main

sys.exit(main())
