"""How a command runs: specmerge's warnings as one line each, and SIGTERM / SIGHUP handled as Ctrl-C is."""

from __future__ import annotations

import argparse
import contextlib
import functools
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator

from specmerge.errors import SpecmergeWarning


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
