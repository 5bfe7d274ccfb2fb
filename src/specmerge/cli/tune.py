"""``specmerge tune RECIPE --eval CMD -o OUT``: every setting of a search space merged and scored, the best kept."""

from __future__ import annotations

import argparse
import sys

from specmerge.cli.running import plain_warnings


@plain_warnings
def tune_command(args: argparse.Namespace) -> int:
    from specmerge.pipeline.run.threads import parse_threads
    from specmerge.tuning.tune import tune

    if args.timeout is not None and args.timeout <= 0:
        raise ValueError(f"--timeout must be a number of seconds > 0, got {args.timeout}")
    result = tune(
        args.recipe,
        args.output,
        command=args.eval,
        strategy=args.strategy,
        metric=args.metric,
        maximize=False if args.minimize else None,
        cache=args.cache,
        restart=args.restart,
        progress=not args.quiet,
        threads=parse_threads(args.threads),
        timeout=args.timeout,
        batch=args.batch,
        reuse_products=args.reuse_products,
        device=args.device,
        gpu_memory=args.gpu_memory,
        log=(lambda line: None) if args.quiet else (lambda line: print(line, file=sys.stderr)),
    )
    best = result.best
    shown = ", ".join(f"{k}={v}" for k, v in best.params.items())
    print(f"best of {len({s.key for s in result.scores})} settings: {shown} (score {best.score:.6g})")
    print(f"model: {result.best_model}; table: {result.folder / 'results.md'} ({result.seconds:.1f} s)")
    return 0


def configure(sub: argparse._SubParsersAction) -> None:
    """Add the ``tune`` subcommand to ``sub``."""
    p = sub.add_parser(
        "tune",
        help="merge every setting of a search space, score each with your evaluation, keep the best model",
        description="Merge the recipe at every setting of its search space (the file's 'tune:' section; default: "
        "the paper's grid for the method), score each with --eval, write results.csv/.md, plots and the best model "
        "to OUT/best. Spectral methods decompose each layer once (a spectral cache) and re-synthesize every other "
        "setting from it. Run it again in the same OUT to resume: settings already scored are skipped.",
    )
    p.add_argument("recipe", help="recipe file (YAML) with an optional 'tune:' section (see docs/tuning.md)")
    p.add_argument(
        "--eval",
        required=True,
        metavar="CMD",
        help="shell command scoring the model folder put in place of {model}; it prints a number, or a JSON object "
        "(--metric names the key) as its last line; with --strategy halving, {budget} is the share of the evaluation "
        "to run (0 < budget <= 1)",
    )
    p.add_argument("-o", "--output", required=True, help="tune folder: results, plots, best/ and the cache (resumed)")
    p.add_argument("--metric", help="the key of the score when --eval prints a JSON object")
    p.add_argument("--minimize", action="store_true", help="lower scores are better (default: higher)")
    p.add_argument("--strategy", choices=["grid", "halving"], help="grid (default) or successive halving")
    p.add_argument("--cache", help="spectral cache folder (default OUT/cache); share it between tunes of one model set")
    p.add_argument("--restart", action="store_true", help="discard the scores of another recipe or space held in OUT")
    p.add_argument(
        "--batch",
        type=int,
        default=8,
        metavar="N",
        help="merge up to N settings in one pass over the inputs (their models wait on disk for their evaluation; "
        "never more than half the free disk holds; default 8)",
    )
    p.add_argument(
        "--reuse-products",
        action="store_true",
        help="within a pass, spectral settings that keep nested sets of directions (SWUDI at several r) build each "
        "filter product on the previous one: several times faster on a CPU, equal to specmerge merge to float32 "
        "rounding instead of bit for bit",
    )
    p.add_argument(
        "--device",
        metavar="DEV",
        help="compute on this device instead of the recipe's: cpu, cuda, cuda:N, auto (see docs/gpu.md)",
    )
    p.add_argument(
        "--gpu-memory",
        metavar="SIZE",
        help="device memory the tune may use on a GPU, e.g. 20GiB (default: the free memory less 10 %%); the spectral "
        "cache stays on the device when it takes at most half of it",
    )
    p.add_argument("--timeout", type=float, help="stop if one evaluation runs longer than this many seconds")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars or notes")
    p.add_argument("--threads", metavar="N", help="compute with N threads (as for merge)")
    p.set_defaults(run=tune_command)
