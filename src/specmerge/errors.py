"""The project's one error type for bad input: every user mistake is a ``SpecmergeError`` with a one-line message.

Subclasses say which layer found the problem (``SourceError``: a checkpoint file; ``RecipeError``: the recipe
or the command line; ``PlanError``: the checkpoints do not fit together; ``OutputError``: the output folder;
``NonFiniteError``: NaN or Inf in an input). The command line prints the message after ``specmerge: error:``
and exits 2; anything that is not a ``SpecmergeError`` is a bug in specmerge.
"""

from __future__ import annotations


class SpecmergeError(ValueError):
    """Bad input or an unusable location; the message names the file, tensor or key and what to do."""
