"""Check that every accuracy figure of README.md, BENCHMARKS.md and docs/ is computed from a committed record.

    python bench/check_figures.py                # the repository's documents; exit 1 and one line per problem
    python bench/check_figures.py docs/x.md      # only these

See ``specmerge_bench.figures`` for the `<!-- record: ... -->` line each accuracy table carries.
"""

from __future__ import annotations

import sys
from pathlib import Path

from specmerge_bench.figures import main

if __name__ == "__main__":
    sys.exit(main(["--root", str(Path(__file__).resolve().parent.parent), *sys.argv[1:]]))
