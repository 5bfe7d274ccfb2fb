"""Keep the accuracy benchmark's small records in the repository, so that a fresh machine can go on from them.

    python bench/accuracy_keep.py --cache /work/benchdata/accuracy            # into bench/results/accuracy
    python bench/accuracy_keep.py --cache CACHE --out DIR

Copies every JSON record of the cache (task manifests with their SHA-256, stage summaries, each expert's own
scores, the score caches, the results folders) and the results' tables, same layout, nothing larger than 4 MiB
and no model, delta or token file (``specmerge_bench.accuracy.keep``). Run it while a long benchmark runs and commit
the folder stage by stage. Then, on a fresh machine:

    specmerge-bench accuracy --cache CACHE ... --scores-from bench/results/accuracy   # scores by weights reused
    python bench/accuracy_settings.py --setting "8 tasks, LoRA=bench/results/accuracy/scores/<key>/seed0-....json"
"""

from __future__ import annotations

from pathlib import Path

from specmerge_bench.accuracy.keep import KeepError, keep
from specmerge_bench.inputs import Parser, fail

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "accuracy"


def main() -> None:
    parser = Parser(prog="accuracy_keep.py", description=__doc__.splitlines()[0])
    parser.add_argument("--cache", required=True, type=Path, help="the --cache of specmerge-bench accuracy")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"where to keep them (default {DEFAULT_OUT})")
    args = parser.parse_args()
    try:
        kept, large = keep(args.cache, args.out)
    except (KeepError, OSError) as err:
        fail(parser.prog, str(err))
    print(f"kept {len(kept)} records of {args.cache} in {args.out}")
    for path in large:
        print(f"left out (over 4 MiB): {path}")


if __name__ == "__main__":
    main()
