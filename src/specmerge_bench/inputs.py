"""Command-line inputs of the benchmarks: a parser whose errors are one line, and checks of model folders.

Every benchmark entry point (``specmerge-bench`` and the scripts in ``bench/``) parses its arguments with
:class:`Parser` and checks the folders it is given with :func:`model_folder` / :func:`model_family`, so
that a missing or wrong input is one line on stderr naming the path and the layout expected (exit status
2), never a traceback. :func:`cached_setting` does the same for the accuracy benchmark's cache in the tools that
only read its experts.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from specmerge.cli.running import PlainHelpParser

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


class Parser(PlainHelpParser):
    """``argparse.ArgumentParser`` whose errors are one line ``PROG: error: MESSAGE`` (exit 2), no usage dump, and
    whose help is plain text (:class:`~specmerge.cli.running.PlainHelpParser`)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def fail(prog: str, message: str) -> NoReturn:
    """Stop with one line ``PROG: error: MESSAGE`` on stderr and exit status 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def model_folder(parser: argparse.ArgumentParser, folder: Path, what: str) -> Path:
    """``folder`` if it is a Hugging Face model folder (config.json + weights), else a one-line error."""
    if not folder.is_dir():
        parser.error(f"{what} {folder} is not a folder")
    if not (folder / "config.json").is_file() or not any((folder / name).is_file() for name in WEIGHT_FILES):
        parser.error(f"{what} {folder} is not a model folder (config.json and {' or '.join(WEIGHT_FILES)} expected)")
    return folder


def model_family(
    parser: argparse.ArgumentParser,
    models: Path,
    experts: Sequence[str] | str = "expert",
    *,
    generate: str = "",
) -> tuple[Path, list[Path]]:
    """``(MODELS/base, experts)`` of a folder of generated models, checked; one-line errors name what is missing.

    ``experts``: the expert folder names required (e.g. ``expert0`` .. ``expert3``), or a prefix: every
    ``MODELS/<prefix>*`` folder, at least one. ``generate`` names the command that writes the layout.
    """
    hint = f" (write them with `{generate}`)" if generate else ""
    if not models.is_dir():
        parser.error(f"--models {models} is not a folder; it must hold base/ and the experts{hint}")
    base = model_folder(parser, models / "base", "base model")
    if isinstance(experts, str):
        found = sorted(p for p in models.iterdir() if p.is_dir() and p.name.startswith(experts))
        if not found:
            parser.error(f"--models {models} holds no {experts}*/ folders{hint}")
        return base, found
    missing = [name for name in experts if not (models / name).is_dir()]
    if missing:
        expected = ", ".join(f"{name}/" for name in ["base", *experts])
        parser.error(f"--models {models} lacks {', '.join(f'{name}/' for name in missing)} (expected {expected}){hint}")
    return base, [models / name for name in experts]


def cached_setting(parser: argparse.ArgumentParser, args: argparse.Namespace, n_tasks: int = 8) -> dict:
    """For a tool that only reads experts: ``build_setting`` of ``args.cache``, ``args.seeds``, ``args.track`` in
    ``args.precision``, refusing (one line, through ``parser``) a cache without the track's experts of a seed
    rather than training them."""
    from specmerge_bench.accuracy import precision
    from specmerge_bench.accuracy.data import AccuracyDataError
    from specmerge_bench.accuracy.settings import build_setting

    if not args.cache.is_dir():
        parser.error(f"--cache {args.cache} is not a folder")
    folder = "lora-experts" if args.track == "lora" else "experts"
    for seed in args.seeds:
        if not any((args.cache / folder).glob(f"*/seed{seed}/*/scores.json")):
            build = f"specmerge-bench accuracy --cache {args.cache} --track {args.track} --seeds {seed}"
            build += f" --tasks {n_tasks}" if n_tasks != 8 else ""
            parser.error(f"--cache {args.cache} holds no {args.track} experts of seed {seed}; run `{build}`")
    precision.choose(args.precision)
    try:
        return build_setting(args.cache.resolve(), args.seeds, n_tasks, track=args.track, train_missing=False)
    except (AccuracyDataError, OSError) as err:
        fail(parser.prog, str(err))
