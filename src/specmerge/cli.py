"""Command line: `specmerge methods` lists the merge methods and their parameters; `specmerge demo` runs the demo."""

from __future__ import annotations

import argparse
import sys
import textwrap

from specmerge.registry import Method, get_method, methods


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


def _methods_command(args: argparse.Namespace) -> int:
    chosen = [get_method(args.name)] if args.name else list(methods().values())
    print("\n\n".join(describe(m) for m in chosen))
    return 0


def _demo_command(args: argparse.Namespace) -> int:
    from specmerge.demo import main as demo_main

    demo_main(seed=args.seed)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specmerge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("methods", help="list the merge methods and their parameters")
    p.add_argument("name", nargs="?", help="show only this method")
    p.set_defaults(run=_methods_command)
    p = sub.add_parser("demo", help="merge a synthetic layer with every method and print a table")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=_demo_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError) as err:
        print(f"specmerge: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
