"""Validation-only probes behind the accuracy benchmark's method ordering (BENCHMARKS.md, issue 5 and 21 notes).

    python bench/accuracy_investigate.py --cache /work/benchdata/accuracy --seeds 0 1 2
    python bench/accuracy_investigate.py --cache DIR --precision float32 --tasks 16 --seeds 2 \
        --probes scale --scales 0.5 0.6 0.7 0.8 0.9 1.0

Uses the cached experts of ``specmerge-bench accuracy --cache DIR`` (run that first: this script refuses a
cache without the seeds' experts rather than training them) and scores on the VALIDATION splits only (no test
split is read), for every seed:

1. ``scale``: final scales other than the benchmark's grid (default s in 1.0, 1.25, 1.5, 2.0; ``--scales``) for
   TSV-M, Iso-C, OptMerge, WUDI-300, SWUDI (r = 0.55, t = 1800), SWUDI-A (psqrt, Gavish-Donoho): does the grid
   cap a method, or put its best between two grid points?
2. ``init``: tau_init for SWUDI-A psqrt and the exponential filter (t = 1300): sum (default) vs mean vs zero,
   over the benchmark's scale grid: how much of the gap between D C^+ and SWUDI is the starting point?
3. ``norms``: the task-vector norms of the experts (the verb expert's larger update, see the notes).
Prints mean validation accuracy over the tasks (mean over seeds, and per seed).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from specmerge_bench.accuracy import model as accuracy_model
from specmerge_bench.accuracy import precision
from specmerge_bench.accuracy.bench import SCALES
from specmerge_bench.accuracy.cache_files import load_experts, load_scoring
from specmerge_bench.accuracy.merging import Candidate, merge_candidates
from specmerge_bench.accuracy.settings import SETTINGS
from specmerge_bench.inputs import Parser, cached_setting

BEYOND = (1.0, 1.25, 1.5, 2.0)
SCALE_PROBES = [  # scored in this order, the claimed comparison (TSV-M against SWUDI-A and SWUDI) first
    Candidate("tsv_m", "tsv_m"),
    Candidate("swudi_a_psqrt", "swudi_a", {"rule": "psqrt"}),
    Candidate("swudi", "swudi", {"rank_ratio": 0.55, "t": 1800.0}),
    Candidate("iso_c", "iso_c"),
    Candidate("optmerge", "optmerge"),
    Candidate("swudi_a_gd", "swudi_a", {"rule": "gavish_donoho"}),
]
WUDI = Candidate("wudi_steps", "wudi", {"steps": 300})  # merge_candidates' label for its wudi_steps sweep
INIT_PROBES = [
    Candidate(f"swudi_a_psqrt_{init}", "swudi_a", {"rule": "psqrt", "tau_init": init})
    for init in ("sum", "mean", "zero")
] + [
    Candidate(f"exponential_{init}", "spectral_filter", {"filter": "exponential", "t": 1300.0, "tau_init": init})
    for init in ("sum", "mean", "zero")
]
PROBES = ("scale", "init", "norms")


def main() -> None:
    parser = Parser(prog="accuracy_investigate.py", description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, required=True, help="the cache folder of specmerge-bench accuracy")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds (default 0 1 2)")
    parser.add_argument("--tasks", type=int, choices=sorted(SETTINGS), default=8, help="the setting (default 8)")
    parser.add_argument("--precision", choices=precision.PRECISIONS, default="auto",
                        help="as the benchmark's: bfloat16 autocast or float32 (auto: bf16 if native)")  # fmt: skip
    parser.add_argument("--probes", choices=PROBES, nargs="+", default=list(PROBES),
                        help="which probes (default all: scale init norms)")  # fmt: skip
    parser.add_argument("--scales", type=float, nargs="+", default=list(BEYOND),
                        help=f"the scale probe's final scales (default {' '.join(map(str, BEYOND))})")  # fmt: skip
    parser.set_defaults(track="full")
    args = parser.parse_args()
    if any(s <= 0 for s in args.scales):
        parser.error(f"--scales must be positive, got {' '.join(map(str, args.scales))}")
    built = cached_setting(parser, args, args.tasks)
    base_model, base, tasks_encoded, heads = load_scoring(built)
    scaled = SCALE_PROBES if "scale" in args.probes else []
    inits = INIT_PROBES if "init" in args.probes else []
    jobs = [(c, s) for c in [*scaled, *([WUDI] if scaled else [])] for s in args.scales]
    jobs += [(c, s) for c in inits for s in SCALES]
    table: dict[tuple[str, float], list[float]] = {}
    norms: dict[str, list[float]] = {}
    for seed in args.seeds:
        experts = load_experts(built, seed, base)
        for task, state in experts.items():
            delta = sum(float((state[n].float() - base[n].float()).pow(2).sum()) for n in base if "encoder" in n)
            norms.setdefault(task, []).append(delta**0.5)
        if jobs:
            deltas = merge_candidates(base, list(experts.values()), scaled + inits,
                                      wudi_steps=[WUDI.params["steps"]] if scaled else [], progress=False)  # fmt: skip
        for candidate, scale in jobs:
            state = deltas.state(base, candidate, scale)
            val = accuracy_model.evaluate(state, tasks_encoded, heads, "val", scratch=base_model)
            mean_val = statistics.mean(val.values())
            table.setdefault((candidate.label, scale), []).append(mean_val)
            print(f"seed {seed}: {candidate.label} s = {scale}: val {100 * mean_val:.2f}", flush=True)
        print(f"seed {seed} done", flush=True)
    print(f"\n{len(built['tasks'])} tasks, precision {precision.tag()}, seeds {' '.join(map(str, args.seeds))}")
    if table:
        print("\n| candidate | s | mean val acc (mean over seeds) | per seed |\n|---|---:|---:|---|")
        for (label, scale), values in table.items():
            per_seed = ", ".join(f"{100 * v:.2f}" for v in values)
            print(f"| {label} | {scale} | {100 * statistics.mean(values):.2f} | {per_seed} |")
    if "norms" in args.probes:
        print("\n| expert | ||tau||_F over the encoder (mean over seeds) |\n|---|---:|")
        for task, values in norms.items():
            print(f"| {task} | {statistics.mean(values):.2f} |")


if __name__ == "__main__":
    main()
