"""``python -m specmerge_bench.accuracy.data --cache DIR [--seed N] [--tasks 16]``: build the tasks, print sizes."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from specmerge_bench.accuracy.data.fetch import AccuracyDataError, fetch_sources
from specmerge_bench.accuracy.data.more_tasks import MORE_TASKS
from specmerge_bench.accuracy.data.store import SPLITS, build_tasks
from specmerge_bench.accuracy.data.tasks import TASKS


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m specmerge_bench.accuracy.data --cache DIR [--seed N] [--tasks 16]``: build, print a table."""
    parser = argparse.ArgumentParser(
        prog="python -m specmerge_bench.accuracy.data",
        description="Build the accuracy benchmark's tasks from Debian packages.",
    )
    parser.add_argument("--cache", required=True, type=Path, help="cache directory (sources/ and tasks/)")
    parser.add_argument("--seed", type=int, default=0, help="data seed (default 0)")
    parser.add_argument("--tasks", type=int, choices=(8, 16), default=8,
                        help="8 (default): the eight tasks; 16: also the eight more of the 16-task set")  # fmt: skip
    args = parser.parse_args(argv)
    try:
        start = time.perf_counter()
        record = fetch_sources(args.cache)
        fetched = time.perf_counter()
        sets = (TASKS,) if args.tasks == 8 else (TASKS, MORE_TASKS)
        manifests = [build_tasks(args.cache, args.seed, names=names) for names in sets]
        built = time.perf_counter()
    except (AccuracyDataError, OSError) as err:
        print(f"specmerge_bench.accuracy.data: error: {err}", file=sys.stderr)
        return 2
    release = record["release"]
    folders = ", ".join(str(args.cache / manifest["tasks_dir"]) for manifest in manifests)
    print(f"{release['origin']} {release['codename']} {release['version']}, tasks in {folders}")
    print(f"{'task':<28} {'classes':>7} {'train':>6} {'val':>5} {'test':>5}")
    for name, entry in ((n, e) for manifest in manifests for n, e in manifest["tasks"].items()):
        sizes = [entry["splits"][split]["size"] for split in SPLITS]
        print(f"{name:<28} {len(entry['labels']):>7} {sizes[0]:>6} {sizes[1]:>5} {sizes[2]:>5}")
    print(f"fetch {fetched - start:.1f} s, build {built - fetched:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
