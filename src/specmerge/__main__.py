"""`python -m specmerge ...` is the `specmerge` command."""

import sys

from specmerge.cli import main

sys.exit(main())
