"""Beyond the edges of the accuracy benchmark's grids, on validation only: where a chosen setting sits on an edge.

    python bench/grid_edges.py --cache /work/benchdata/accuracy --track lora --precision float32 --seeds 0

On the LoRA track (seed 0, float32) D C+ chose s = 0.1, the grid's smallest scale, and SWUDI chose r = 0.55 and
t = 1800, the most regularised corner of its grid (BENCHMARKS.md). This scores, on the VALIDATION splits only
(no test split is read), D C+ and SWUDI-A psqrt at scales down to 0.02 and SWUDI at smaller r and larger t than
the grid holds. Experts come from the cache (``specmerge-bench accuracy`` first; nothing is trained); LoRA
experts are merged as their ``merge_and_unload`` checkpoints, which the adapter path equals (tests, and
``bench/lora_equivalence.py`` on these adapters). Prints mean validation accuracy over the tasks per setting.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from specmerge_bench.accuracy import model as accuracy_model
from specmerge_bench.accuracy import precision
from specmerge_bench.accuracy.cache_files import load_experts, load_scoring
from specmerge_bench.accuracy.merging import Candidate, merge_candidates
from specmerge_bench.inputs import Parser, cached_setting

PROBES = [(Candidate("closed_form", "closed_form"), (0.02, 0.05, 0.1))] + [
    (Candidate(f"swudi r={r} t={t:g}", "swudi", {"rank_ratio": r, "t": t}), (0.1, 0.2, 0.3))
    for r in (0.35, 0.55)
    for t in (1800.0, 4000.0)
] + [(Candidate("swudi_a_psqrt", "swudi_a", {"rule": "psqrt"}), (0.05, 0.1, 0.15, 0.2))]  # fmt: skip


def main() -> None:
    parser = Parser(prog="grid_edges.py", description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, required=True, help="the cache folder of specmerge-bench accuracy")
    parser.add_argument("--track", choices=("full", "lora"), default="lora", help="the experts (default lora)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="training seeds (default 0)")
    parser.add_argument("--precision", choices=precision.PRECISIONS, default="auto",
                        help="as the benchmark's: bfloat16 autocast or float32 (auto: bf16 if native)")  # fmt: skip
    args = parser.parse_args()
    built = cached_setting(parser, args, 8)
    base_model, base, tasks_encoded, heads = load_scoring(built)
    table: dict[tuple[str, float], list[float]] = {}
    for seed in args.seeds:
        if args.track == "lora":
            from specmerge_bench.accuracy.lora import dense_expert

            folders = built["paths"]["experts"][seed]
            experts = [{n: t for n, t in dense_expert(base_model, f).items() if n in base} for f in folders.values()]
        else:
            experts = list(load_experts(built, seed, base).values())
        deltas = merge_candidates(base, experts, [c for c, _ in PROBES], progress=False)
        for candidate, scales in PROBES:
            for scale in scales:
                state = deltas.state(base, candidate, scale)
                val = accuracy_model.evaluate(state, tasks_encoded, heads, "val", scratch=base_model)
                table.setdefault((candidate.label, scale), []).append(statistics.mean(val.values()))
                print(f"seed {seed} | {candidate.label} | s={scale} | {100 * table[candidate.label, scale][-1]:.2f}",
                      flush=True)  # fmt: skip
    print(f"\n{args.track} experts, precision {precision.tag()}, seeds {' '.join(map(str, args.seeds))}")
    print("\n| candidate | s | mean val acc (mean over seeds) | per seed |\n|---|---:|---:|---|")
    for (label, scale), values in table.items():
        per_seed = ", ".join(f"{100 * v:.2f}" for v in values)
        print(f"| {label} | {scale} | {100 * statistics.mean(values):.2f} | {per_seed} |")


if __name__ == "__main__":
    main()
