"""Command line: `specmerge merge`, `specmerge run RECIPE`, `specmerge inspect`, `specmerge methods`, `demo`."""

from __future__ import annotations

import argparse
import contextlib
import functools
import signal
import sys
import textwrap
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from specmerge.methods.registry import Method, all_methods, get_method


def describe(method: Method, width: int = 100) -> str:
    """A method's summary, citation and parameters (name, type, default, help) as plain text."""
    lines = [f"{method.name}{'' if method.needs_matrix else '  (any tensor shape)'}"]
    lines += textwrap.wrap(method.summary, width, initial_indent="  ", subsequent_indent="  ")
    if method.citation:
        lines.append(f"  [{method.citation}]")
    for p in method.params:
        lines.append(f"    {p.name}: {p.type_name} = {p.default!r}")
        lines += textwrap.wrap(p.help, width, initial_indent="        ", subsequent_indent="        ")
    return "\n".join(lines)


def _plain_warnings(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Run ``command`` with specmerge's notices (:class:`SpecmergeWarning`) printed as one line each,
    ``specmerge: warning: ...``, on stderr; other warnings as Python shows them."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        from specmerge.errors import SpecmergeWarning

        with warnings.catch_warnings():
            show = warnings.showwarning

            def plain(message, category, filename, lineno, file=None, line=None) -> None:
                if issubclass(category, SpecmergeWarning):
                    print(f"specmerge: warning: {message}", file=sys.stderr)
                else:
                    show(message, category, filename, lineno, file, line)

            warnings.showwarning = plain
            return command(args)

    return run


def _methods_command(args: argparse.Namespace) -> int:
    chosen = [get_method(args.name)] if args.name else list(all_methods().values())
    print("\n\n".join(describe(m) for m in chosen))
    return 0


def _demo_command(args: argparse.Namespace) -> int:
    from specmerge.demo import main as demo_main

    demo_main(seed=args.seed, workdir=args.workdir)
    return 0


def _bench_command(args: argparse.Namespace) -> int:
    if args.which == "speed":
        from specmerge_bench.speed import main as speed_main

        return speed_main(args.rest)
    from specmerge_bench.accuracy.bench import main as accuracy_main

    return accuracy_main(args.rest)


def _recipe_value(flag: str, text: str) -> Any:
    """A recipe value typed on the command line, read as the same text in a YAML recipe is (``0.5``, ``true``,
    ``psqrt``, ``5GB``; ``''`` stays the empty string), so that the command line and a recipe accept and
    refuse exactly the same values: the recipe's validation decides."""
    import yaml

    from specmerge.pipeline.recipe import RecipeError

    if not text.strip():
        return text
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or "not a YAML value"
        raise RecipeError(f"{flag} {text!r}: not a valid value ({problem}); quote it as in a recipe") from None


def _parse_params(pairs: list[str]) -> dict:
    """``k=v`` strings to a dict; values read as in a YAML recipe (0.5, true, .inf, psqrt), validated by the method."""
    from specmerge.pipeline.recipe import RecipeError

    params = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise RecipeError(f"--param expects key=value, got '{pair}'")
        params[key.strip()] = _recipe_value(f"--param {key.strip()}=", value)
    return params


@_plain_warnings
def _merge_command(args: argparse.Namespace) -> int:
    from specmerge.pipeline.api import merge

    options = {  # every option given is the recipe's to validate, empty or zero included
        key: _recipe_value(flag, value)
        for key, flag, value in (
            ("dtype", "--dtype", args.dtype),
            ("device", "--device", args.device),
            ("shard_size", "--shard-size", args.shard_size),
            ("output_format", "--output-format", args.output_format),
            ("max_rank", "--max-rank", args.max_rank),
        )
        if value is not None
    }
    report = merge(
        args.base,
        args.experts,
        args.output,
        method=args.method,
        params=_parse_params(args.param),
        overwrite=args.overwrite,
        progress=not args.quiet,
        fsync=not args.no_fsync,
        threads=_threads(args),
        **options,
    )
    _print_summary(report, args.output)
    return 0


@_plain_warnings
def _run_command(args: argparse.Namespace) -> int:
    from specmerge.pipeline.api import run_recipe
    from specmerge.pipeline.recipe import load_recipe

    report = run_recipe(
        load_recipe(args.recipe),
        args.output,
        overwrite=args.overwrite,
        progress=not args.quiet,
        fsync=not args.no_fsync,
        threads=_threads(args),
    )
    _print_summary(report, args.output)
    return 0


@_plain_warnings
def _inspect_command(args: argparse.Namespace) -> int:
    from specmerge.diagnostics.inspect import DEFAULT_METHODS, inspect_model

    options = {
        key: value
        for key, value in (
            ("layers", args.layers),
            ("methods", tuple(args.method) if args.method else DEFAULT_METHODS),
            ("rank_ratio", args.rank_ratio),
            ("t", args.t),
            ("wudi", not args.no_wudi),
            ("wudi_layer", args.wudi_layer),
            ("wudi_steps", args.wudi_steps),
            ("adam_lr", args.adam_lr),
            ("gd_lr", args.gd_lr),
            ("compute_dtype", args.compute_dtype),
            ("device", args.device),
            ("plots", not args.no_plots),
        )
        if value is not None
    }
    summary = inspect_model(
        args.base,
        args.experts,
        args.output,
        overwrite=args.overwrite,
        progress=not args.quiet,
        threads=_threads(args),
        **options,
    )
    print(f"inspected {summary['layers_inspected']} layers in {summary['seconds']:.1f} s -> {args.output}/report.md")
    return 0


def _print_summary(report: dict, output: str) -> None:
    print(f"merged {len(report['tensors'])} tensors with {report['method']} in {report['seconds']:.1f} s -> {output}")
    adapter = report.get("adapter")
    if adapter:
        print(
            f"adapter: {adapter['modules']} modules, rank <= {adapter['max_rank']}, "
            f"largest discarded energy {adapter['max_discarded_energy']:.2e}"
        )


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", required=True, help="new model folder (must not exist unless --overwrite)")
    p.add_argument(
        "--overwrite", action="store_true", help="replace an existing folder that specmerge wrote (or an empty one)"
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--no-fsync",
        action="store_true",
        help="do not flush the output to disk before renaming it into place (faster on slow disks, as other "
        "tools do; a power cut or OS crash soon after may then leave an incomplete model folder)",
    )
    _add_threads_argument(p)


def _add_threads_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads",
        metavar="N",
        help="compute with N threads (default: the CPUs this process may use, less those other processes keep "
        "busy, less one for reading and writing when two or more remain; OMP_NUM_THREADS if set)",
    )


def _threads(args: argparse.Namespace) -> int | None:
    """``--threads`` checked (a whole number >= 1: one line otherwise) or None for the default."""
    from specmerge.pipeline.threads import parse_threads

    return parse_threads(args.threads)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specmerge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("methods", help="list the merge methods and their parameters")
    p.add_argument("name", nargs="?", help="show only this method")
    p.set_defaults(run=_methods_command)
    p = sub.add_parser("merge", help="merge experts fine-tuned from BASE into a new model folder")
    p.add_argument("base", help="base model: Hugging Face folder or .safetensors file")
    p.add_argument(
        "experts", nargs="+", help="fine-tuned experts of the same base: model folders/files or PEFT LoRA adapters"
    )
    p.add_argument("-m", "--method", default="swudi_a", help="merge method (see `specmerge methods`)")
    p.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE", help="method parameter")
    p.add_argument("--dtype", help="output dtype: auto (base's), float32, float16, bfloat16")
    p.add_argument("--device", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--shard-size", help="largest output shard, e.g. 5GB or 500MB")
    p.add_argument(
        "--output-format",
        help="model (default): a merged model folder; lora: a PEFT adapter (every expert a LoRA adapter)",
    )
    p.add_argument("--max-rank", help="lora output: truncate each module to this rank (SVD; energy reported)")
    _add_output_arguments(p)
    p.set_defaults(run=_merge_command)
    p = sub.add_parser("run", help="run a YAML recipe")
    p.add_argument("recipe", help="recipe file (see README)")
    _add_output_arguments(p)
    p.set_defaults(run=_run_command)
    p = sub.add_parser("inspect", help="spectral diagnostics of experts of BASE: tables, plots, report.md")
    p.add_argument("base", help="base model: Hugging Face folder or .safetensors file")
    p.add_argument("experts", nargs="+", help="experts of the same base: model folders/files or PEFT LoRA adapters")
    p.add_argument("-o", "--out", "--output", dest="output", required=True, help="new report folder")
    p.add_argument(
        "--overwrite", action="store_true", help="replace an existing folder that specmerge wrote (or an empty one)"
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--layers", metavar="REGEX", help="inspect only the 2-D layers whose name matches")
    p.add_argument(
        "-m", "--method", action="append", metavar="NAME[:K=V,...]", help="method whose merged-delta norm to report "
        "(repeatable; default: closed_form, swudi, swudi_a, swudi_a:rule=gavish_donoho, tsv_m, iso_c, "
        "task_arithmetic, weight_average)"
    )  # fmt: skip
    p.add_argument("--rank-ratio", type=float, help="fixed rank ratio r of the SWUDI cut (default: swudi's, 0.65)")
    p.add_argument("--t", type=float, help="exponential filter time of the filter plot (default: swudi's, 1300)")
    p.add_argument("--wudi-layer", metavar="NAME", help="layer of the optimizer-as-filter and filter-shape plots")
    p.add_argument("--wudi-steps", type=int, help="iterative WUDI steps on that layer (default 300)")
    p.add_argument("--adam-lr", type=float, help="Adam learning rate (default 1e-5, WUDI's)")
    p.add_argument("--gd-lr", type=float, help="plain gradient descent step (default 0.25 / lambda_max)")
    p.add_argument("--no-wudi", action="store_true", help="skip the optimizer-as-filter diagnostic")
    p.add_argument("--no-plots", action="store_true", help="tables and report.md only")
    p.add_argument("--compute-dtype", choices=["float32", "float64"], help="dense layers (default float32)")
    p.add_argument("--device", help="cpu, cuda, cuda:N or auto")
    _add_threads_argument(p)
    p.set_defaults(run=_inspect_command)
    p = sub.add_parser("bench", help="benchmarks: `specmerge bench accuracy --cache DIR`, `specmerge bench speed`")
    p.add_argument("which", choices=["accuracy", "speed"])
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of the benchmark (--help for them)")
    p.set_defaults(run=_bench_command)
    p = sub.add_parser("demo", help="build a tiny model and 4 experts, merge them with several methods, print a table")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", help="keep the demo's models and merges in this folder (default: a temporary one)")
    p.set_defaults(run=_demo_command)
    return parser


class _Signalled(BaseException):
    """Raised in the main thread when SIGTERM or SIGHUP arrives, so that the command cleans up as for Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """While the block runs, SIGTERM and SIGHUP raise :class:`_Signalled` in the main thread (once; repeats are
    ignored while the work in progress is removed). Signals ignored by the caller (``nohup``) stay ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        for other in previous:
            signal.signal(other, signal.SIG_IGN)
        raise _Signalled(signum)

    previous: dict[int, object] = {}
    for signum in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if signum is not None and signal.getsignal(signum) is not signal.SIG_IGN:
            previous[signum] = signal.signal(signum, stop)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with _stop_on_signals():
            return args.run(args)
    except KeyboardInterrupt:
        print("specmerge: interrupted (Ctrl-C); no unfinished output is left behind", file=sys.stderr)
        return 128 + signal.SIGINT
    except _Signalled as stop:
        name = signal.Signals(stop.signum).name
        print(f"specmerge: stopped by {name}; no unfinished output is left behind", file=sys.stderr)
        return 128 + stop.signum
    except (ValueError, TypeError, OSError) as err:
        print(f"specmerge: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
