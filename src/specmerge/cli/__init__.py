"""Command line: `specmerge merge`, `specmerge run RECIPE`, `specmerge inspect`, `specmerge methods`, `demo`, `bench`.

The options of ``merge`` and ``inspect`` are generated from the Recipe and InspectOptions models (flags,
help, defaults, checks); a bad value is one line ``specmerge: error: ...`` and exit status 2.
"""

from __future__ import annotations

import argparse
import signal
import sys

from specmerge.cli.commands import bench_command, build_parser, describe
from specmerge.cli.running import Signalled, broken_pipe, flush_stdout, stop_on_signals

__all__ = ["build_parser", "describe", "main"]

# Optional dependencies -> the extra that installs them (pyproject.toml), named when one is missing.
OPTIONAL_EXTRAS = {"transformers": "hf", "tokenizers": "hf", "matplotlib": "plots"}


def main(argv: list[str] | None = None) -> int:
    """Run ``specmerge`` with ``argv`` (default: the process's arguments); return the exit status. Output cut short
    by its reader (``specmerge methods | head -3``) ends quietly, status 141 (:func:`.running.broken_pipe`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # every argument is specmerge-bench's, --help included
        return bench_command(argparse.Namespace(bench_args=argv[1:]))
    try:
        args = build_parser(__doc__).parse_args(argv)
        with stop_on_signals():
            status = args.run(args)
        flush_stdout()
        return status
    except BrokenPipeError as err:
        return broken_pipe(err, "specmerge")
    except KeyboardInterrupt:
        print("specmerge: interrupted (Ctrl-C); no unfinished output is left behind", file=sys.stderr)
        return 128 + signal.SIGINT
    except Signalled as stop:
        name = signal.Signals(stop.signum).name
        print(f"specmerge: stopped by {name}; no unfinished output is left behind", file=sys.stderr)
        return 128 + stop.signum
    except ModuleNotFoundError as err:
        extra = OPTIONAL_EXTRAS.get((err.name or "").partition(".")[0])
        if extra is None:
            raise
        print(
            f"specmerge: error: this command needs {err.name} (optional): pip install 'specmerge[{extra}]'",
            file=sys.stderr,
        )
        return 2
    except (ValueError, TypeError, OSError) as err:
        print(f"specmerge: error: {err}", file=sys.stderr)
        return 2
