"""Validation-only probes behind the accuracy benchmark's method ordering (BENCHMARKS.md, issue 5 notes).

    python bench/accuracy_investigate.py --cache /work/benchdata/accuracy --seeds 0 1 2

Uses the cached experts of ``specmerge-bench accuracy --cache DIR`` (run that first: this script refuses a
cache without ``experts/<key>/seed<k>/`` folders rather than building them) and scores on the VALIDATION
splits only (no test split is read), for every seed:

1. scale beyond the benchmark's grid (s in 1.0, 1.25, 1.5, 2.0) for TSV-M, Iso-C, WUDI-300, SWUDI-A
   (psqrt, Gavish-Donoho): does the grid's top (s = 1.0, chosen by every spectral method) cap them?
2. tau_init for SWUDI-A psqrt and the exponential filter (t = 1300): sum (default) vs mean vs zero,
   over the benchmark's scale grid: how much of the gap between D C^+ and SWUDI is the starting point?
3. the task-vector norms of the experts (the verb expert's larger update, see the notes).
Prints mean validation accuracy over the tasks (mean over seeds, and per seed).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from specmerge_bench.accuracy import model as accuracy_model
from specmerge_bench.accuracy import precision
from specmerge_bench.accuracy.bench import SCALES
from specmerge_bench.accuracy.cache_files import load_experts, load_scoring
from specmerge_bench.accuracy.data import AccuracyDataError
from specmerge_bench.accuracy.experts import build_experts
from specmerge_bench.accuracy.merging import Candidate, merge_candidates
from specmerge_bench.inputs import Parser, fail

BEYOND = (1.0, 1.25, 1.5, 2.0)
SCALE_PROBES = [
    Candidate("tsv_m", "tsv_m"),
    Candidate("iso_c", "iso_c"),
    Candidate("swudi_a_psqrt", "swudi_a", {"rule": "psqrt"}),
    Candidate("swudi_a_gd", "swudi_a", {"rule": "gavish_donoho"}),
]
INIT_PROBES = [
    Candidate(f"swudi_a_psqrt_{init}", "swudi_a", {"rule": "psqrt", "tau_init": init})
    for init in ("sum", "mean", "zero")
] + [
    Candidate(f"exponential_{init}", "spectral_filter", {"filter": "exponential", "t": 1300.0, "tau_init": init})
    for init in ("sum", "mean", "zero")
]


def main() -> None:
    parser = Parser(prog="accuracy_investigate.py", description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, required=True, help="the cache folder of specmerge-bench accuracy")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training seeds (default 0 1 2)")
    parser.add_argument("--precision", choices=precision.PRECISIONS, default="auto",
                        help="as the benchmark's: bfloat16 autocast or float32 (auto: bf16 if native)")  # fmt: skip
    args = parser.parse_args()
    precision.choose(args.precision)  # the precision the cache's experts and probes were built with
    for seed in args.seeds:
        if not any((args.cache / "experts").glob(f"*/seed{seed}/*/model.safetensors")):
            parser.error(f"--cache {args.cache} holds no experts of seed {seed} (experts/<key>/seed{seed}/<task>/); "
                         f"run `specmerge-bench accuracy --cache {args.cache} --seeds {seed}` first")  # fmt: skip
    try:
        built = build_experts(args.cache.resolve(), args.seeds, log=lambda line: None)
    except (AccuracyDataError, OSError) as err:
        fail(parser.prog, str(err))
    base_model, base, tasks_encoded, heads = load_scoring(built)
    table: dict[tuple[str, float], list[float]] = {}
    norms: dict[str, list[float]] = {}
    for seed in args.seeds:
        experts = load_experts(built, seed, base)
        for task, state in experts.items():
            delta = sum(float((state[n].float() - base[n].float()).pow(2).sum()) for n in base if "encoder" in n)
            norms.setdefault(task, []).append(delta**0.5)
        deltas = merge_candidates(base, list(experts.values()), SCALE_PROBES + INIT_PROBES,
                                  wudi_steps=[300], progress=False)  # fmt: skip
        wudi = Candidate("wudi_steps", "wudi", {"steps": 300})
        jobs = [(c, s) for c in [*SCALE_PROBES, wudi] for s in BEYOND] + [(c, s) for c in INIT_PROBES for s in SCALES]
        for candidate, scale in jobs:
            state = deltas.state(base, candidate, scale)
            val = accuracy_model.evaluate(state, tasks_encoded, heads, "val", scratch=base_model)
            table.setdefault((candidate.label, scale), []).append(statistics.mean(val.values()))
        print(f"seed {seed} done", flush=True)
    print("\n| candidate | s | mean val acc (mean over seeds) | per seed |\n|---|---:|---:|---|")
    for (label, scale), values in table.items():
        per_seed = ", ".join(f"{100 * v:.1f}" for v in values)
        print(f"| {label} | {scale} | {100 * statistics.mean(values):.2f} | {per_seed} |")
    print("\n| expert | ||tau||_F over the encoder (mean over seeds) |\n|---|---:|")
    for task, values in norms.items():
        print(f"| {task} | {statistics.mean(values):.2f} |")


if __name__ == "__main__":
    main()
