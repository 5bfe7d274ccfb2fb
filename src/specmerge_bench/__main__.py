"""``python -m specmerge_bench``: the same as the ``specmerge-bench`` command."""

import sys

from specmerge_bench.cli import main

sys.exit(main())
