"""``specmerge-bench``: the benchmarks' command line (``speed``, ``accuracy``), outside the specmerge core."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from specmerge.cli.running import broken_pipe, flush_stdout
from specmerge.errors import SpecmergeError
from specmerge_bench.inputs import Parser


def build_parser() -> Parser:
    """The ``specmerge-bench`` parser: one subcommand per benchmark, each configured by its own module."""
    from specmerge_bench import speed
    from specmerge_bench.accuracy import bench as accuracy

    parser = Parser(
        prog="specmerge-bench",
        description="Benchmarks of specmerge: per-layer speed and memory, and accuracy on real data (BENCHMARKS.md).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{speed,accuracy}")
    speed.configure(sub.add_parser(
        "speed", help="per-layer time and peak memory of every featured method on synthetic layers",
        description=(speed.__doc__ or "").split("\n")[0],
    ))  # fmt: skip
    accuracy.configure(sub.add_parser(
        "accuracy", help="offline accuracy benchmark: MiniLM experts on 8 Debian-derived tasks, every method",
        description=(accuracy.__doc__ or "").split("\n")[0],
    ))  # fmt: skip
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one benchmark; a bad input is one line on stderr and exit status 2, never a traceback; output cut short by
    its reader (``| head``) ends quietly, status 141 (:func:`specmerge.cli.running.broken_pipe`)."""
    from specmerge_bench.accuracy.data import AccuracyDataError

    try:
        args = build_parser().parse_args(argv)
    except BrokenPipeError as err:  # --help into a closed pipe
        return broken_pipe(err, "specmerge-bench")
    try:
        status = args.run(args)
        flush_stdout()
        return status
    except BrokenPipeError as err:
        return broken_pipe(err, f"specmerge-bench {args.command}")
    except (AccuracyDataError, SpecmergeError, OSError) as err:
        print(f"specmerge-bench {args.command}: error: {err}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:
        if (err.name or "").partition(".")[0] not in ("transformers", "tokenizers", "matplotlib"):
            raise
        print(
            f"specmerge-bench {args.command}: error: this benchmark needs {err.name} (optional): "
            "pip install 'specmerge[bench]'",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(f"specmerge-bench {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
