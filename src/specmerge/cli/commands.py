"""The subcommands and their parser; the recipe and inspect options come from the models (:mod:`.fields`).

Only what is not a field of :class:`~specmerge.pipeline.recipe.model.Recipe` or
:class:`~specmerge.diagnostics.options.InspectOptions` is declared here: the output folder, ``--overwrite``,
``--quiet``, ``--verbose``, ``--no-fsync``, ``--threads`` and the arguments of ``methods`` and ``demo``.
"""

from __future__ import annotations

import argparse
import functools
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

from specmerge.cli.fields import add_fields, field_values, flag_error
from specmerge.cli.running import PlainHelpParser, add_verbosity, plain_warnings, run_child
from specmerge.diagnostics.options import InspectOptions
from specmerge.errors import RecipeError
from specmerge.methods import Method, all_methods, get_method
from specmerge.pipeline.recipe.model import Recipe
from specmerge.version import __version__

# Recipe fields the `merge` command does not offer, and why (a recipe file has them: `specmerge run`).
# recipe keys `specmerge merge` does not offer, and why (every other has a flag; overrides: --override PATTERN=RULE)
NOT_ON_COMMAND_LINE: dict[str, str] = {"layers": "a frankenmerge has no experts to merge: write it as a recipe"}
PATHS = ("base", "experts")  # positional arguments of merge and inspect


def capabilities(method: Method) -> list[str]:
    """What the method declares about itself, in words (shown by ``specmerge methods``)."""
    found = ["linear in the deltas (merged row block by row block)"] if method.linear else []
    found.append("exact on LoRA cores" if method.factored else "densifies LoRA experts")
    if method.spectral:
        found.append("spectral (specmerge tune re-synthesizes its settings from one decomposition per layer)")
    if method.seeded:
        found.append("seeded (random per tensor and expert, reproducible)")
    if method.weighting:
        found.append("per-expert weights" + (" (> 0)" if method.weighting == "positive" else ""))
    if method.needs_base:
        found.append("merges whole weights with the base's")
    found.append("2-D weights only" if method.needs_matrix else "any tensor shape")
    if method.variant_of:
        found.append(f"variant of {method.variant_of}")
    if not method.featured:
        found.append("not featured (left out of the default lists of demo, speed and inspect)")
    return found


def describe(method: Method, width: int = 100) -> str:
    """A method's title, summary, capabilities, citation and parameters (name, type, default, help) as plain text."""
    lines = [method.name + (f"  ({method.title})" if method.title != method.name else "")]
    lines += textwrap.wrap(method.summary, width, initial_indent="  ", subsequent_indent="  ")
    lines += textwrap.wrap(", ".join(capabilities(method)), width, initial_indent="  ", subsequent_indent="    ")
    if method.citation:
        lines.append(f"  [{method.citation}]")
    for p in method.params:
        lines.append(f"    {p.name}: {p.type_name} = {p.default!r}")
        lines += textwrap.wrap(p.help, width, initial_indent="        ", subsequent_indent="        ")
    return "\n".join(lines)


def methods_command(args: argparse.Namespace) -> int:
    chosen = [get_method(args.name)] if args.name else list(all_methods().values())
    print("\n\n".join(describe(m) for m in chosen))
    return 0


def schema_command(args: argparse.Namespace) -> int:
    import json

    from specmerge.pipeline.recipe.schema import recipe_schema

    print(json.dumps(recipe_schema(), indent=1))
    return 0


def announced(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Run ``command`` printing on stderr, before the work, one line per input resolved from the Hugging Face hub
    (or local path shadowing a cached hub id; any local path of an id's shape with ``--verbose``), and the
    download progress; ``--quiet`` prints neither."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        from specmerge.io.hub.ids import announce_inputs

        with announce_inputs(not args.quiet, verbose=args.verbose):
            return command(args)

    return run


def _output_options(args: argparse.Namespace) -> dict:
    """The keyword arguments of a merge's output that ``merge`` and ``run`` share."""
    return {
        "overwrite": args.overwrite,
        "progress": not args.quiet,
        "fsync": not args.no_fsync,
        "threads": _threads(args),
    }


@announced
@plain_warnings
def merge_command(args: argparse.Namespace) -> int:
    from specmerge.pipeline.run import api

    paths = field_values(args, Recipe)  # every option given is the recipe's to validate, empty or zero included
    base, experts = paths.pop("base"), paths.pop("experts")
    try:
        recipe = api.merge_recipe(base, experts, **paths)
    except RecipeError as err:
        raise flag_error(err, Recipe) from None  # the flag typed, not the recipe key it became
    if _dry(args):
        return _dry_run(recipe, args)
    report = api.run_recipe(recipe, args.output, **_output_options(args))
    _print_summary(report, args.output)
    return 0


@announced
@plain_warnings
def run_command(args: argparse.Namespace) -> int:
    from specmerge.pipeline.recipe.mergekit import load_mergekit, say_conversion
    from specmerge.pipeline.recipe.model import load_recipe
    from specmerge.pipeline.run.api import run_recipe

    conversion = load_mergekit(args.recipe)  # a mergekit config, recognised by its keys, or None
    if conversion is not None:  # said even with --quiet: where the meaning differs from mergekit's
        say_conversion(conversion)
    recipe = load_recipe(args.recipe) if conversion is None else conversion.recipe
    if _dry(args):
        return _dry_run(recipe, args)
    report = run_recipe(recipe, args.output, **_output_options(args))
    _print_summary(report, args.output)
    return 0


def convert_command(args: argparse.Namespace) -> int:
    from specmerge.pipeline.recipe.mergekit import load_mergekit

    conversion = load_mergekit(args.config)
    if conversion is None:
        raise RecipeError(f"{args.config} is not a mergekit config (merge_method with models): nothing to convert")
    text = conversion.to_yaml(str(args.config))
    if args.output is None:
        print(text, end="")
        return 0
    target = Path(args.output)
    if target.exists() and not args.overwrite:
        raise RecipeError(f"'{target}' exists: choose another file or pass --overwrite")
    target.write_text(text, encoding="utf-8")
    print(f"wrote {target}", file=sys.stderr)
    return 0


@announced
@plain_warnings
def inspect_command(args: argparse.Namespace) -> int:
    from specmerge.diagnostics.run import inspect_model

    paths = field_values(args, Recipe)
    summary = inspect_model(
        paths["base"],
        paths["experts"],
        args.output,
        overwrite=args.overwrite,
        progress=not args.quiet,
        threads=_threads(args),
        **field_values(args, InspectOptions),
    )
    print(f"inspected {summary['layers_inspected']} layers in {summary['seconds']:.1f} s -> {args.output}/report.md")
    return 0


def demo_command(args: argparse.Namespace) -> int:
    from specmerge.demo import main as demo_main

    demo_main(seed=args.seed, workdir=args.workdir)
    return 0


def bench_command(args: argparse.Namespace) -> int:
    """``specmerge bench ARGS`` runs ``specmerge-bench ARGS`` and returns its exit status. The benchmarks are their
    own package (``specmerge_bench``), which the library never imports, so they run as a child process of this
    interpreter (:func:`~specmerge.cli.running.run_child`: Ctrl-C, SIGTERM and SIGHUP stop it and what it
    started, and this one waits for them)."""
    return run_child([sys.executable, "-m", "specmerge_bench.cli", *args.bench_args])


def _dry(args: argparse.Namespace) -> bool:
    """Whether this is a dry run; refuses a merge without -o and --json without --dry-run (one line each)."""
    if args.json and not args.dry_run:
        raise ValueError("--json prints a dry run's estimate: add --dry-run")
    if args.output is None and not args.dry_run:
        raise ValueError("-o/--output is required: the new model folder (or --dry-run to only see the plan)")
    return args.dry_run


def _dry_run(recipe: Recipe, args: argparse.Namespace) -> int:
    """Print the plan and its estimated cost (a table, or JSON with every tensor); nothing is written."""
    import json

    from specmerge.pipeline.estimate.dryrun import dry_run, format_estimate

    options = {k: v for k, v in _output_options(args).items() if k != "progress"}
    estimate = dry_run(recipe, args.output, tensors=args.json, **options)
    print(json.dumps(estimate, indent=1, default=str) if args.json else format_estimate(estimate))
    return 0


def _print_summary(report: dict, output: str) -> None:
    print(f"merged {len(report['tensors'])} tensors with {report['method']} in {report['seconds']:.1f} s -> {output}")
    adapter = report.get("adapter")
    if adapter:
        print(
            f"adapter: {adapter['modules']} modules, rank <= {adapter['max_rank']}, "
            f"largest discarded energy {adapter['max_discarded_energy']:.2e}"
        )


def _threads(args: argparse.Namespace) -> int | None:
    """``--threads`` checked (a whole number >= 1: one line otherwise) or None for the default."""
    from specmerge.pipeline.run.threads import parse_threads

    return parse_threads(args.threads)


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--overwrite", action="store_true", help="replace an existing folder that specmerge wrote (or an empty one)"
    )
    add_verbosity(p, "no progress bar, no download progress, no hub resolution lines (warnings are still printed)")
    p.add_argument(
        "--threads",
        metavar="N",
        help="compute with N threads (default: the CPUs this process may use, less those other processes keep "
        "busy, less one for reading and writing when two or more remain; OMP_NUM_THREADS if set)",
    )


def _add_model_output(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-o", "--output", help="new model folder (must not exist unless --overwrite); required but with --dry-run"
    )
    _add_output_arguments(p)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the plan (which tensors get which action, method and route), the bytes to read and write, the "
        "peak memory and the time it would take; read no tensor, write nothing (-o, if given, is checked)",
    )
    p.add_argument("--json", action="store_true", help="with --dry-run: print the estimate as JSON, every tensor too")
    p.add_argument(
        "--no-fsync",
        action="store_true",
        help="do not flush the output to disk before renaming it into place (faster on slow disks, as other "
        "tools do; a power cut or OS crash soon after may then leave an incomplete model folder)",
    )


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The ``specmerge`` parser: each subcommand's ``run`` is set as the ``run`` default of its arguments."""
    parser = PlainHelpParser(prog="specmerge", description=description)
    parser.add_argument("--version", action="version", version=f"specmerge {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("methods", help="list the merge methods, their capabilities and parameters")
    p.add_argument("name", nargs="?", help="show only this method")
    p.set_defaults(run=methods_command)

    p = sub.add_parser("schema", help="print the JSON Schema of a recipe (every method and its parameters)")
    p.set_defaults(run=schema_command)

    p = sub.add_parser("merge", help="merge experts fine-tuned from BASE into a new model folder")
    add_fields(p, Recipe, PATHS, positional=True)
    _add_model_output(p)
    add_fields(p, Recipe, [name for name in Recipe.model_fields if name not in (*PATHS, *NOT_ON_COMMAND_LINE)])
    p.set_defaults(run=merge_command)

    p = sub.add_parser("run", help="run a YAML recipe")
    p.add_argument("recipe", help="recipe file (YAML; see docs/recipes.md)")
    _add_model_output(p)
    p.set_defaults(run=run_command)

    p = sub.add_parser(
        "convert", help="print the specmerge recipe of a mergekit config (and where the meaning differs)"
    )
    p.add_argument("config", help="mergekit config (YAML)")
    p.add_argument("-o", "--output", help="write the recipe to this file (default: print it)")
    p.add_argument("--overwrite", action="store_true", help="replace the file --output names")
    p.set_defaults(run=convert_command)

    p = sub.add_parser("inspect", help="spectral diagnostics of experts of BASE: tables, plots, report.md")
    add_fields(p, Recipe, PATHS, positional=True)
    p.add_argument("-o", "--out", "--output", dest="output", required=True, help="new report folder")
    _add_output_arguments(p)
    add_fields(p, InspectOptions)
    p.set_defaults(run=inspect_command)

    p = sub.add_parser("demo", help="build a tiny model and 4 experts, merge them with several methods, print a table")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", help="keep the demo's models and merges in this folder (default: a temporary one)")
    p.set_defaults(run=demo_command)
    p = sub.add_parser("bench", add_help=False, help="the benchmarks: the same as specmerge-bench (speed, accuracy)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="specmerge-bench's arguments")
    p.set_defaults(run=bench_command)
    from specmerge.cli.adamerge import configure as configure_adamerge
    from specmerge.cli.tune import configure as configure_tune

    configure_tune(sub)
    configure_adamerge(sub)
    return parser
