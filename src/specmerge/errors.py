"""The project's one error type for bad input: every user mistake is a ``SpecmergeError`` with a one-line message.

Subclasses say which layer found the problem (``SourceError``: a checkpoint file; ``RecipeError``: the recipe
or the command line; ``PlanError``: the checkpoints do not fit together; ``OutputError``: the output folder;
``NonFiniteError``: NaN or Inf in an input). The command line prints the message after ``specmerge: error:``
and exits 2; anything that is not a ``SpecmergeError`` is a bug in specmerge. Notices that do not stop the
work (a PEFT default used for a key a config leaves out) are ``SpecmergeWarning``s; the command line prints
them after ``specmerge: warning:``.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence


class SpecmergeError(ValueError):
    """Bad input or an unusable location; the message names the file, tensor or key and what to do."""

    def __init__(self, message: object = "", *args: object) -> None:
        # One line whatever the user typed: a name or path with a line break is shown escaped.
        text = str(message)
        if "\n" in text or "\r" in text:
            text = text.replace("\r", "\\r").replace("\n", "\\n")
        super().__init__(text, *args)


class NonFiniteError(SpecmergeError):
    """An input tensor holds NaN or Inf; the message names the tensor, the file and how many entries."""


class RecipeError(SpecmergeError):
    """An invalid recipe or option value. ``loc`` is the place in the recipe document (keys and list indices),
    when known."""

    def __init__(self, message: str, loc: tuple[str | int, ...] | list[str | int] = ()) -> None:
        super().__init__(message)
        self.loc = tuple(loc)


class SpecmergeWarning(UserWarning):
    """A notice about the input that does not stop the work (a default used for a missing key, ...)."""


def closest_name(name: str, known: Sequence[str], *, cutoff: float = 0.6) -> str | None:
    """The known name most like ``name`` (difflib similarity at least ``cutoff``; 0: always one), or None."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=cutoff)
    return close[0] if close else None


def unknown_name_message(
    what: str, name: str, known: Sequence[str], *, compared: str | None = None, foreign: str | None = None
) -> str:
    """The one did-you-mean message: ``unknown <what> '<name>': did you mean '<closest>'? known: a, b, c``;
    ``compared`` is the form of ``name`` matched against ``known`` (default: ``name`` as typed). ``foreign``: what
    ``name`` means in another tool and what to write instead (:mod:`specmerge.foreign`), given in place of the
    closest name, which would be a wrong guess."""
    if foreign is not None:
        return f"unknown {what} '{name}': {foreign}"
    close = closest_name(name if compared is None else compared, known)
    hint = f"did you mean '{close}'? " if close else ""
    return f"unknown {what} '{name}': {hint}known: {', '.join(sorted(known))}"
