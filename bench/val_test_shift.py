"""Is a gap between two rows that differs on val and on test larger than the split's sampling noise?

    python bench/val_test_shift.py --cache DIR --precision float32 --tasks 16 --seeds 2 \
        [--rows tsv_m swudi_a_psqrt] [--draws 10000]

In the 16-task setting TSV-M leads SWUDI-A psqrt by 0.1-0.5 points on val and by 1.0-1.3 on test in all three seeds
(BENCHMARKS.md, "Three seeds of the 16-task main table"). The seeds share one val / test split, so their agreement
does not say whether the shift belongs to the methods or to that split. This script takes, for each seed, the two
rows' settings chosen on val (from the benchmark's score file), rebuilds their merges (from the merge store when it
holds them) and scores every val and test sentence. It checks the per-task accuracies against the score file, then
reports, per task and averaged over the tasks as the benchmark averages:

- the gap A - B on val and on test, and the shift (test gap - val gap);
- b and c, the sentences only A or only B gets right, and the shift's sentence-level standard error;
- a re-split test: each task's val and test sentences pooled and dealt again into a val and a test of the same
  sizes (``--draws`` times, seeded), the shift recomputed each time; the two-sided share of draws with a shift at
  least as large as the observed one.

Then, for every row whose merge is in the merge store, its chosen setting's test mean - val mean and how far it
moved the weights from the base (||merged - base||_F): does the drop from val to test follow the distance?

Both measures of the shift treat the sentences as independent. The splits are group-disjoint, and val and test take
at most one text per group and class (``specmerge_bench.accuracy.data.splits``): where a group has one class, each
val or test sentence is its own group's, so re-dealing sentences is re-dealing groups; only groups whose texts span
classes (packages, sources) can put two sentences into one split. A shift far outside the re-split spread is one
that the split's sampling does not explain; ``--subset`` repeats the summary for some tasks (e.g. those whose groups
have one class). Reads the cached experts; trains nothing. Reads the test split (a report on settings already
chosen on val; nothing is chosen here).
"""

from __future__ import annotations

import functools
import statistics
from pathlib import Path

import torch

from specmerge_bench.accuracy import precision
from specmerge_bench.accuracy.bench import best_on_val, full_merge
from specmerge_bench.accuracy.cache_files import load_experts, load_scoring
from specmerge_bench.accuracy.merge_store import MergeStore, seed_store, stored_merge, sweep_split
from specmerge_bench.accuracy.merging import MergedDeltas
from specmerge_bench.accuracy.model import correct, load_state
from specmerge_bench.accuracy.rows import method_rows, step_rows
from specmerge_bench.accuracy.scores import ScoreCache, score_paths
from specmerge_bench.accuracy.settings import SETTINGS
from specmerge_bench.inputs import Parser, cached_setting, fail


def resplit_shifts(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], draws: int, seed: int = 0) -> torch.Tensor:
    """``draws`` shifts (mean over tasks of test gap - val gap, in points) with each task's val and test sentences
    pooled and dealt again at random into splits of the original sizes. ``pairs``: task -> (val, test) per-sentence
    differences A - B (-1, 0 or 1)."""
    generator = torch.Generator().manual_seed(seed)
    total = torch.zeros(draws, dtype=torch.float64)
    for val, test in pairs.values():
        pooled = torch.cat([val, test]).to(torch.float64)
        for start in range(0, draws, 500):
            n = min(500, draws - start)
            order = torch.rand(n, len(pooled), generator=generator).argsort(1)
            dealt = pooled[order]
            total[start : start + n] += dealt[:, len(val) :].mean(1) - dealt[:, : len(val)].mean(1)
    return 100 * total / len(pairs)


def shift_error(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Sentence-level standard error (points) of the mean over tasks of test gap - val gap."""
    variance = sum(float(d.to(torch.float64).var()) / len(d) for split in pairs.values() for d in split)
    return 100 * variance**0.5 / len(pairs)


def every_row(cache: ScoreCache, store: MergeStore, base: dict[str, torch.Tensor]) -> None:
    """Each row's chosen setting: test mean - val mean, and how far its merge moved the weights (||merged - base||_F
    over every tensor); rows whose merge is not in ``store`` are left out (nothing is merged here)."""
    print("| row | choice | s | test - val (points) | ||merged - base||_F |\n|---|---|---:|---:|---:|")
    base_drop = statistics.fmean(cache.scores["base|test"].values()) - statistics.fmean(
        cache.scores["base|val"].values()
    )
    print(f"| base | | | {100 * base_drop:+.2f} | 0 |")
    for row in {row.label: row for row in method_rows() + step_rows()}.values():  # D C+ is in both
        val, candidate, scale = best_on_val(row, cache)
        if not store.has(candidate.key):
            continue
        deltas = MergedDeltas({}, {}, {})
        store.load(candidate.key, deltas, candidate.key)
        state = deltas.state(base, candidate, scale)
        norm = sum(float((state[n].double() - base[n].double()).pow(2).sum()) for n in base) ** 0.5
        drop = statistics.fmean(cache.scores[f"{candidate.key}|{scale}|test"].values()) - val
        print(f"| {row.label} | {candidate.describe()} | {scale} | {100 * drop:+.2f} | {norm:.2f} |")


def main() -> None:
    parser = Parser(prog="val_test_shift.py", description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, required=True, help="the cache folder of specmerge-bench accuracy")
    parser.add_argument("--tasks", type=int, choices=sorted(SETTINGS), default=16, help="the setting (default 16)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[2], help="training seeds (default 2)")
    parser.add_argument("--precision", choices=precision.PRECISIONS, default="auto",
                        help="as the benchmark's: bfloat16 autocast or float32 (auto: bf16 if native)")  # fmt: skip
    rows = {row.label: row for row in method_rows() + step_rows()}
    parser.add_argument("--rows", nargs=2, choices=sorted(rows), default=["tsv_m", "swudi_a_psqrt"],
                        metavar=("A", "B"), help="the two rows, A - B (default tsv_m swudi_a_psqrt)")  # fmt: skip
    parser.add_argument("--draws", type=int, default=10_000, help="re-split draws (default 10000)")
    parser.add_argument("--subset", nargs="+", default=[], metavar="TASK",
                        help="also summarise the shift over these tasks only")  # fmt: skip
    parser.set_defaults(track="full")
    args = parser.parse_args()
    if args.draws < 1:
        parser.error(f"--draws must be at least 1, got {args.draws}")
    built = cached_setting(parser, args, args.tasks)
    unknown = sorted(set(args.subset) - set(built["tasks"]))
    if unknown:
        parser.error(f"--subset: {' '.join(unknown)} not among the setting's tasks ({' '.join(built['tasks'])})")
    base_model, base, tasks_encoded, heads = load_scoring(built)
    print(f"{args.rows[0]} - {args.rows[1]}, {len(built['tasks'])} tasks, precision {precision.tag()}\n")
    for seed in args.seeds:
        path, _ = score_paths(args.cache.resolve(), built["experts_key"], seed)
        if not path.is_file():
            fail(parser.prog, f"{path} is missing: run `specmerge-bench accuracy` for seed {seed} first")
        cache = ScoreCache(path)
        chosen = [best_on_val(rows[label], cache)[1:] for label in args.rows]
        experts = load_experts(built, seed, base)
        store = seed_store(args.cache.resolve(), built["experts_key"], seed)
        merge = stored_merge(functools.partial(full_merge, base, list(experts.values())), store)
        deltas = merge(*sweep_split(candidate for candidate, _ in chosen), False)
        right: list[dict[str, dict[str, torch.Tensor]]] = []
        for candidate, scale in chosen:
            load_state(base_model, deltas.state(base, candidate, scale))
            by_split = {}
            for split in ("val", "test"):
                by_split[split] = {t: correct(base_model, tasks_encoded[t][split], heads[t]) for t in built["tasks"]}
                kept = cache.scores[f"{candidate.key}|{scale}|{split}"]
                for task, flags in by_split[split].items():
                    if abs(float(flags.double().mean()) - kept[task]) > 0.5 / len(flags):
                        fail(parser.prog, f"seed {seed}: {candidate.describe()} s={scale} scores "
                             f"{float(flags.double().mean()):.4f} on {split} {task}, the score file "
                             f"{kept[task]:.4f}: not the merge the benchmark scored")  # fmt: skip
            right.append(by_split)
        pairs = {t: (right[0]["val"][t].long() - right[1]["val"][t].long(),
                     right[0]["test"][t].long() - right[1]["test"][t].long()) for t in built["tasks"]}  # fmt: skip
        print(f"seed {seed}: A = {chosen[0][0].describe()} s={chosen[0][1]}, B = {chosen[1][0].describe()} "
              f"s={chosen[1][1]} (chosen on val; per-task scores match the score file)\n")  # fmt: skip
        report(pairs)
        summary(pairs, args.draws, seed, "all tasks")
        if args.subset:
            summary({t: pairs[t] for t in args.subset}, args.draws, seed, f"{len(args.subset)} tasks")
        print()
        every_row(cache, store, base)
        print()


def report(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Per task: the gaps on val and test, b / c, the shift."""
    print("| task | val gap | b / c (val) | test gap | b / c (test) | shift |")
    print("|---|---:|---:|---:|---:|---:|")
    for task, (val, test) in pairs.items():
        gaps = [100 * float(d.double().mean()) for d in (val, test)]
        counts = [f"{int((d > 0).sum())} / {int((d < 0).sum())}" for d in (val, test)]
        print(f"| {task} | {gaps[0]:+.2f} | {counts[0]} | {gaps[1]:+.2f} | {counts[1]} | {gaps[1] - gaps[0]:+.2f} |")
    print()


def summary(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], draws: int, seed: int, name: str) -> None:
    """Averaged over ``pairs``' tasks: the gaps, the shift, its standard error and the re-split share."""
    val_gap = statistics.fmean(100 * float(v.double().mean()) for v, _ in pairs.values())
    test_gap = statistics.fmean(100 * float(t.double().mean()) for _, t in pairs.values())
    observed = test_gap - val_gap
    shifts = resplit_shifts(pairs, draws, seed=seed)
    share = float((shifts.abs() >= abs(observed) - 1e-9).double().mean())
    print(f"mean over {name}: val gap {val_gap:+.2f}, test gap {test_gap:+.2f}, shift {observed:+.2f} points; "
          f"sentence-level standard error of the shift {shift_error(pairs):.2f}; re-split ({draws} draws): "
          f"std {float(shifts.std()):.2f}, share with |shift| >= {abs(observed):.2f}: {share:.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
