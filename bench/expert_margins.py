"""How clearly each expert beats the base on its own task's val (or test) split: accuracies, McNemar's exact test.

    python bench/expert_margins.py --cache DIR [--track full|lora] [--tasks 8|16] [--seeds 0 1 2] [--precision P] \
        [--split val|test]

The accuracy benchmark asks every expert to beat the base on its own task on val by a clear margin. The two are
scored on the same val sentences, so the test is paired: b sentences only the expert gets right, c only the base,
and under "neither is better" b is Binomial(b + c, 1/2). Prints, per seed and task, base and expert val accuracy,
the gap, b, c and the exact two-sided p-value (``scipy.stats.binomtest``). Reads the cached experts of
``specmerge-bench accuracy`` (LoRA adapters scored as their ``merge_and_unload`` checkpoints, as the benchmark
does); an expert not in the cache is an error, never trained here. The test split is read only with ``--split
test``: a report on experts the protocol has already fixed (800 steps, nothing chosen), with twice val's sentences.
"""

from __future__ import annotations

import copy
from pathlib import Path

from specmerge_bench.accuracy import model as accuracy_model
from specmerge_bench.accuracy import precision
from specmerge_bench.accuracy.cache_files import load_experts, load_scoring
from specmerge_bench.accuracy.model import correct
from specmerge_bench.accuracy.settings import SETTINGS
from specmerge_bench.inputs import Parser, cached_setting


def main() -> None:
    from scipy.stats import binomtest

    parser = Parser(prog="expert_margins.py", description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, required=True, help="the cache folder of specmerge-bench accuracy")
    parser.add_argument("--track", choices=("full", "lora"), default="full", help="which experts (default full)")
    parser.add_argument("--tasks", type=int, choices=sorted(SETTINGS), default=8, help="the setting (default 8)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="training seeds (default 0)")
    parser.add_argument("--precision", choices=precision.PRECISIONS, default="auto",
                        help="as the benchmark's: bfloat16 autocast or float32 (auto: bf16 if native)")  # fmt: skip
    parser.add_argument("--split", choices=("val", "test"), default="val",
                        help="the split both are scored on (default val; test reports, chooses nothing)")  # fmt: skip
    args = parser.parse_args()
    built = cached_setting(parser, args, args.tasks)
    base_model, base, tasks_encoded, heads = load_scoring(built)
    scratch = copy.deepcopy(base_model)  # each expert's weights are loaded into it in turn
    split = args.split
    base_right = {task: correct(base_model, tasks_encoded[task][split], heads[task]) for task in built["tasks"]}
    print(f"{args.track} experts, {len(built['tasks'])} tasks, precision {precision.tag()}, {split} split\n")
    print(
        f"| seed | task | base {split} | expert {split} | gap | b (expert only) | c (base only) | p (McNemar, exact) |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for seed in args.seeds:
        if args.track == "lora":
            from specmerge_bench.accuracy.lora import dense_expert

            experts = {t: dense_expert(base_model, folder) for t, folder in built["paths"]["experts"][seed].items()}
        else:
            experts = load_experts(built, seed, base)
        for task, state in experts.items():
            accuracy_model.load_state(scratch, state)
            mine, theirs = correct(scratch, tasks_encoded[task][split], heads[task]), base_right[task]
            b, c = int((mine & ~theirs).sum()), int((theirs & ~mine).sum())
            p = binomtest(b, b + c, 0.5).pvalue if b + c else 1.0
            acc = lambda right: float(right.double().mean())  # noqa: E731
            print(f"| {seed} | {task} | {acc(theirs):.3f} | {acc(mine):.3f} | {acc(mine) - acc(theirs):+.3f} | "
                  f"{b} | {c} | {p:.1e} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
