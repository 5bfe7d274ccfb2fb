"""What a plan adds up to: counts and bytes per action, method and reason (:func:`summarize`), and the console's
account of the tensors that do not get the recipe's method (:func:`not_merged_line`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from specmerge.io.output.folder import OUTPUT_LOG
from specmerge.pipeline.plan.rules import EMBEDDING_REASONS, TensorPlan


def summarize(plan: Sequence[TensorPlan]) -> dict[str, Any]:
    """Counts and output bytes in total, per action, per method (merges) and per reason."""

    def tally(groups: dict[str, dict[str, int]], key: str, nbytes: int) -> None:
        group = groups.setdefault(key, {"tensors": 0, "bytes": 0})
        group["tensors"] += 1
        group["bytes"] += nbytes

    summary: dict[str, Any] = {"tensors": 0, "bytes": 0, "by_action": {}, "by_method": {}, "by_reason": {}}
    for entry in plan:
        nbytes = _numel(entry.shape) * entry.out_dtype.itemsize
        summary["tensors"] += 1
        summary["bytes"] += nbytes
        tally(summary["by_action"], entry.action, nbytes)
        if entry.method is not None:
            tally(summary["by_method"], entry.method, nbytes)
        tally(summary["by_reason"], entry.reason, nbytes)
    return summary


def say_not_merged(plan: Sequence[TensorPlan], method: str) -> None:
    """Say on the console (:func:`not_merged_line`) which tensors do not get ``method``, and why (nothing if all do)."""
    line = not_merged_line(plan, method)
    if line is not None:
        logging.getLogger(OUTPUT_LOG).info(line)


def say_not_merged_once(plans: Sequence[tuple[Sequence[TensorPlan], str]]) -> None:
    """:func:`say_not_merged` for several merges run together (a tune's settings): each distinct line once."""
    said: set[str] = set()
    for plan, method in plans:
        line = not_merged_line(plan, method)
        if line is not None and line not in said:
            said.add(line)
            logging.getLogger(OUTPUT_LOG).info(line)


def not_merged_line(plan: Sequence[TensorPlan], method: str) -> str | None:
    """One line naming what every tensor that does not get ``method`` gets instead, and why, by reason (None:
    every tensor gets it)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for entry in plan:
        if (entry.action == "merge" and entry.method == method) or entry.reason == method == "passthrough":
            continue  # passthrough's copies are what it asks for
        got = (
            entry.method
            if entry.action == "merge"
            else {"average": "averaged", "keep_base": "kept from the base"}[entry.action]
        )
        groups.setdefault((got, entry.reason), []).append(entry.name)
    if not groups:
        return None
    parts = [
        f"{len(names)} {got} ({reason}; e.g. '{names[0]}')" if len(names) > 1 else f"'{names[0]}' {got} ({reason})"
        for (got, reason), names in groups.items()
    ]
    hint = " (merge_embeddings: true gives embeddings the method)" if (
        any(reason == EMBEDDING_REASONS[True] for _, reason in groups)
    ) else ""  # fmt: skip
    return f"not merged with {method}: " + "; ".join(parts) + hint


def _numel(shape: Sequence[int]) -> int:
    count = 1
    for d in shape:
        count *= d
    return count
