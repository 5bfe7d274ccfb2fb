"""The accuracy benchmark's settings side by side: every row, the paper's claims as paired differences, two plots.

    python bench/accuracy_settings.py \\
        --setting "8 tasks, full=CACHE/results/<8-task folder>" \\
        --setting "8 tasks, LoRA=CACHE/results/lora-<folder>" \\
        --setting "16 tasks, full=CACHE/results/<16-task folder>" --out docs/img

Each ``--setting NAME=PATH[,PATH...]`` names one setting's runs: results folders of ``specmerge-bench accuracy``
(``results.json``) and score files ``scores/<experts key>/seed<k>-<code key>-<precision>.json`` of a run stopped
before its end (its finished rows), in a cache or kept by ``bench/accuracy_keep.py``; their seeds are pooled on
the rows every seed has. Prints a
markdown table (average test accuracy per row and setting, mean ± std over that setting's seeds), the paper's
orderings as paired per-seed differences with each row's own seed std (``specmerge_bench.accuracy.compare``), the
WUDI step sweep's best step count, and writes ``accuracy-settings.png`` and ``wudi-steps-settings.png`` in --out.
Where one setting's tasks are a proper subset of another's (8 and 16 tasks, same track), it also prints each row
on the smaller setting's tasks merged alone and within the larger one, paired by seed.
With ``--per-seed``, each setting seed by seed follows (every row per seed with the setting it chose on val, the
paper's claims per seed and in how many seeds each holds, the WUDI sweep per seed). With ``--tables``, each
setting's full tables follow (every row's average, normalised, gap closed and per-task
test accuracy; AdaMerging and the WUDI step sweep), as the benchmark writes them in ``results.md``, over the pooled
seeds. Reads only the results files: no model is loaded and nothing is scored.
"""

from __future__ import annotations

from pathlib import Path

from specmerge_bench.accuracy import report
from specmerge_bench.accuracy.compare import ResultsError, load_setting, markdown, per_seed_markdown, plots
from specmerge_bench.inputs import Parser, fail


def main() -> None:
    parser = Parser(prog="accuracy_settings.py", description=__doc__.splitlines()[0])
    parser.add_argument("--setting", action="append", required=True, metavar="NAME=PATH[,PATH...]",
                        help="a setting's name and its runs (results folders, score files), comma-separated; repeat "
                             "for each setting")  # fmt: skip
    parser.add_argument("--out", type=Path, help="folder for the two plots (default: no plots)")
    parser.add_argument("--tables", action="store_true", help="also each setting's full tables (per task)")
    parser.add_argument("--per-seed", action="store_true",
                        help="also each setting seed by seed: rows, the paper's claims and the WUDI sweep")  # fmt: skip
    args = parser.parse_args()
    settings = {}
    for item in args.setting:
        name, sep, paths = item.partition("=")
        if not sep or not name or not paths:
            parser.error(f"--setting {item!r}: expected NAME=PATH[,PATH...]")
        if name in settings:
            parser.error(f"--setting {name!r} is given twice")
        try:
            settings[name] = load_setting([Path(p) for p in paths.split(",")])
        except ResultsError as err:
            fail(parser.prog, str(err))
    print(markdown(settings))
    for name, setting in settings.items():
        if args.per_seed:
            print(f"\n{per_seed_markdown(name, setting)}")
        if args.tables:
            print(f"\n## {name}\n\n{report.markdown(setting['summary'])}")
    if args.out is not None:
        for path in plots(settings, args.out):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
