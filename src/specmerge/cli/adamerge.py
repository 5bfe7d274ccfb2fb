"""``specmerge adamerge BASE MERGED -o OUT --data FILE``: AdaMerging coefficients on top of a merge (issue 17).

The options mirror :func:`specmerge.tuning.adamerge.adamerge`, which checks their values (a bad one is one line
``specmerge: error: ...``).
"""

from __future__ import annotations

import argparse

from specmerge.cli.running import add_verbosity, plain_warnings


@plain_warnings
def adamerge_command(args: argparse.Namespace) -> int:
    from specmerge.io.hub.ids import announce_inputs
    from specmerge.tuning.adamerge import adamerge

    if args.quiet:
        from specmerge.io.output.tokenizers import transformers_module

        transformers_module("specmerge adamerge").utils.logging.disable_progress_bar()  # no "Loading weights" bar
    with announce_inputs(not args.quiet, verbose=args.verbose):
        report = adamerge(
            args.base,
            args.merged,
            args.output,
            data=args.data,
            task=args.task,
            experts=args.experts,
            steps=args.steps,
            lr=args.lr,
            batch_size=args.batch_size,
            max_length=args.max_length,
            seed=args.seed,
            overwrite=args.overwrite,
            progress=not args.quiet,
            device=args.device,
        )
    print(
        f"adamerge: mean entropy {report['entropy_start']:.4f} -> {report['entropy_end']:.4f} in "
        f"{report['settings']['steps']} steps, {len(report['coefficients'])} layer groups, {report['seconds']:.1f} s "
        f"-> {args.output} (coefficients in {args.output}/adamerge.json)"
    )
    return 0


def configure(sub: argparse._SubParsersAction) -> None:
    """Add the ``adamerge`` subcommand to ``sub`` (the subparsers of :func:`specmerge.cli.commands.build_parser`)."""
    p = sub.add_parser(
        "adamerge",
        help="learn per-layer coefficients on top of a merge by minimising prediction entropy on unlabeled data",
        description="AdaMerging (Yang et al., ICLR 2024) on top of any merge: W = W_0 + lambda_layer (W_merged - W_0) "
        "(+ mu_layer,i (W_i - W_0) with --experts), lambda = 1 and mu = 0 at the start (the merge itself), learned "
        "with Adam by minimising the entropy of the model's predictions on the inputs of --data.",
    )
    p.add_argument("base", metavar="BASE", help="the base model folder the merge started from")
    p.add_argument(
        "merged", metavar="MERGED", help="the merged model folder (written by specmerge merge, or any merge of BASE)"
    )
    p.add_argument(
        "-o", "--output", required=True, metavar="OUT", help="new model folder (must not exist unless --overwrite)"
    )
    p.add_argument(
        "--data",
        required=True,
        metavar="FILE",
        help='unlabeled inputs: a text file (one input per line, blank lines skipped) or a .jsonl file with a "text" '
        '(or "input_ids", a list of token ids) field per line',
    )
    p.add_argument(
        "--task",
        choices=["causal-lm", "classification"],
        default="causal-lm",
        help="causal-lm: next-token entropy (AutoModelForCausalLM); classification: entropy of the classifier head "
        "(AutoModelForSequenceClassification); default causal-lm",
    )
    p.add_argument(
        "--experts",
        nargs="+",
        metavar="E",
        help="expert folders (after BASE MERGED): add a coefficient per layer and expert",
    )
    p.add_argument(
        "--steps", type=int, metavar="N", default=100, help="Adam steps, one batch each (default 100; 0: the merge)"
    )
    p.add_argument(
        "--lr", type=float, metavar="X", default=1e-3, help="Adam's learning rate (default 1e-3, as AdaMerging)"
    )
    p.add_argument("--batch-size", type=int, metavar="N", default=8, help="inputs per batch (default 8)")
    p.add_argument("--max-length", type=int, metavar="N", default=128, help="tokens kept of each input (default 128)")
    p.add_argument("--seed", type=int, metavar="N", default=0, help="seed of the batch order (default 0)")
    p.add_argument(
        "--device",
        default="cpu",
        metavar="DEV",
        help="where the model runs and the coefficients learn: cpu (default), cuda, cuda:N, auto (a GPU when there "
        "is one)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace an existing folder that specmerge wrote (or an empty one)"
    )
    add_verbosity(p, "no progress bars, no hub resolution lines (warnings are still printed)")
    p.set_defaults(run=adamerge_command)
