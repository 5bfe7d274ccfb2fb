"""How a command runs: what it prints (-q/-v, help as plain text), specmerge's warnings as one line each, a closed
stdout (``| head``) as the end of the output, SIGTERM / SIGHUP handled as Ctrl-C is, and a child process (``specmerge
bench``) stopped with this one."""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import select
import signal
import stat
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence

from specmerge.errors import SpecmergeWarning

PIPE_CLOSED = 141  # 128 + SIGPIPE: the status a shell reports for `yes | head -1`, whose reader went first


class PlainHelpParser(argparse.ArgumentParser):
    """An argument parser whose help shows the literals of the docstrings and field descriptions it is made of
    (reStructuredText ````x````) as `x`; its subcommands' parsers are of the same class."""

    def format_help(self) -> str:
        return super().format_help().replace("``", "`")


def broken_pipe(err: BrokenPipeError, prog: str) -> int:
    """The exit status for ``err``: :data:`PIPE_CLOSED`, saying nothing, when the reader of stdout has gone
    (``specmerge methods | head -3``: the output just ends, and stdout goes to the null device so that Python's
    flush at exit says nothing either); any other broken pipe is an error, ``PROG: error: ...``, status 2."""
    if not _stdout_gone():
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return PIPE_CLOSED


def flush_stdout() -> None:
    """Flush stdout at the end of a command, so that a reader gone (``| head``) raises BrokenPipeError here, where
    :func:`broken_pipe` handles it, not in Python's own flush at exit; nothing where there is no stdout (pythonw,
    ``redirect_stdout(None)``)."""
    if sys.stdout is not None:
        sys.stdout.flush()


def _stdout_gone() -> bool:
    """Whether stdout is a pipe or socket that nobody reads any more (poll says so where it can)."""
    try:
        fd = sys.stdout.fileno()
        mode = os.fstat(fd).st_mode
    except (AttributeError, OSError, ValueError):
        return False
    if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
        return False
    if not hasattr(select, "poll"):
        return True  # no way to ask (Windows): a broken pipe while stdout is one is taken as its reader gone
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def add_verbosity(parser: argparse.ArgumentParser, quiet: str) -> None:
    """Add ``-q/--quiet`` (``quiet``: what it leaves out) and ``-v/--verbose``, which exclude each other."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-q", "--quiet", action="store_true", help=quiet)
    group.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also name each local path that has the shape of a Hugging Face hub id (said by default only when the "
        "hub cache holds that id)",
    )


def plain_warnings(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Run ``command`` with specmerge's notices (:class:`SpecmergeWarning`) printed as one line each,
    ``specmerge: warning: ...``, on stderr; other warnings as Python shows them."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
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


class Signalled(BaseException):
    """Raised in the main thread when SIGTERM or SIGHUP arrives, so that the command cleans up as for Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """While the block runs, SIGTERM and SIGHUP raise :class:`Signalled` in the main thread (once; repeats are
    ignored while the work in progress is removed). Signals ignored by the caller (``nohup``) stay ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        for other in previous:
            signal.signal(other, signal.SIG_IGN)
        raise Signalled(signum)

    previous: dict[int, object] = {}
    for signum in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if signum is not None and signal.getsignal(signum) is not signal.SIG_IGN:
            previous[signum] = signal.signal(signum, stop)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)


def run_child(command: Sequence[str]) -> int:
    """Run ``command`` in a process group of its own and return its exit status (killed by signal N: 128 + N, as a
    shell reports it). Ctrl-C, SIGTERM and SIGHUP sent to this process are passed on to that group (the child and
    the processes it starts), and this one waits for the child to end: stopping it never leaves the child running.
    The child is not in the terminal's foreground group, so it must not read the terminal (Ctrl-C reaches it
    through this process). Signals ignored by the caller (``nohup``) stay ignored."""
    child: subprocess.Popen | None = None
    early: list[int] = []  # signals that came before the child existed

    def pass_on(signum: int, frame: object) -> None:
        if child is None:
            early.append(signum)
        else:
            _signal_group(child, signum)

    previous: dict[int, object] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            if signum is not None and signal.getsignal(signum) is not signal.SIG_IGN:
                previous[signum] = signal.signal(signum, pass_on)
    try:
        child = subprocess.Popen(list(command), process_group=0 if os.name == "posix" else None)
        for signum in early:
            _signal_group(child, signum)
        status = child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
    return 128 - status if status < 0 else status


def _signal_group(child: subprocess.Popen, signum: int) -> None:
    """Send ``signum`` to ``child``'s process group (to the child alone where there are none); gone: nothing."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.name == "posix":
            os.killpg(child.pid, signum)
        else:
            child.send_signal(signum)
