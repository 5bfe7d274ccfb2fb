"""A tune's scores: an append-only log on disk (what makes a tune resumable), and the tables and plots made from it.

``results.jsonl`` gets one line per scored (setting, budget), flushed before the next setting starts, so an
interrupted tune loses at most the setting it was merging or scoring; a rerun reads the log and skips what it
holds. ``results.csv`` and ``results.md`` list every full-budget score, best first; ``plots/score_<param>.png``
show the score against each searched parameter (every setting as a dot, the best per value as a line).
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Scored:
    """One evaluation: the setting (key and parameters), the budget, the score, every number the evaluation gave,
    and the seconds spent merging and evaluating."""

    key: str
    params: dict[str, Any]
    budget: float
    score: float
    metrics: dict[str, float] = field(default_factory=dict)
    merge_seconds: float = 0.0
    eval_seconds: float = 0.0


class ResultsLog:
    """The scores of one tune folder: read on opening, appended (and flushed to disk) as they come."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: list[Scored] = []
        self._index: dict[tuple[str, float], Scored] = {}  # (key, budget) -> the first score of it
        lines = path.read_text().splitlines() if path.is_file() else []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                entry = Scored(**json.loads(line))
            except (json.JSONDecodeError, TypeError):
                if number == len(lines):  # cut short by an interruption: dropped, and that setting scored again
                    path.write_text("".join(f"{text}\n" for text in lines[:-1]))
                    continue
                raise ValueError(f"{path}:{number}: not a results line; move the file away to start afresh") from None
            self._remember(entry)

    def _remember(self, entry: Scored) -> None:
        self.entries.append(entry)
        self._index.setdefault((entry.key, entry.budget), entry)

    def find(self, key: str, budget: float) -> Scored | None:
        return self._index.get((key, budget))

    def add(self, entry: Scored) -> None:
        self._remember(entry)
        with self.path.open("a") as f:
            f.write(json.dumps(asdict(entry)) + "\n")
            f.flush()
            os.fsync(f.fileno())


def ranked(entries: Sequence[Scored], maximize: bool) -> list[Scored]:
    """Full-budget scores, best first (ties: the earlier setting first)."""
    full = [e for e in entries if e.budget == 1.0]
    return sorted(full, key=lambda e: -e.score if maximize else e.score)


def write_tables(entries: Sequence[Scored], names: Sequence[str], folder: Path, maximize: bool) -> None:
    """``results.csv`` and ``results.md``: one row per full-budget setting, best first."""
    rows = ranked(entries, maximize)
    metrics = sorted({m for e in rows for m in e.metrics if m != "score"})
    header = ["rank", *names, "score", *metrics, "merge_s", "eval_s", "key"]
    table = [
        [i + 1, *(e.params.get(n) for n in names), e.score, *(e.metrics.get(m) for m in metrics),
         round(e.merge_seconds, 2), round(e.eval_seconds, 2), e.key]
        for i, e in enumerate(rows)
    ]  # fmt: skip
    text = io.StringIO()
    csv.writer(text).writerows([header, *table])
    (folder / "results.csv").write_text(text.getvalue())
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in table]
    (folder / "results.md").write_text("\n".join(lines) + "\n")


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else str(value)


def write_plots(entries: Sequence[Scored], names: Sequence[str], folder: Path, maximize: bool) -> list[Path]:
    """One plot per searched parameter with more than one value: score against it; [] without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    rows = ranked(entries, maximize)
    made = []
    for name in names:
        values = sorted({e.params[name] for e in rows if name in e.params}, key=_order)
        if len(values) < 2:
            continue
        numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
        position = {v: (v if numeric else i) for i, v in enumerate(values)}
        fig, ax = plt.subplots(figsize=(5, 3.4))
        ax.scatter([position[e.params[name]] for e in rows], [e.score for e in rows], s=12, alpha=0.5, label="setting")
        pick = max if maximize else min
        best = [pick(e.score for e in rows if e.params[name] == v) for v in values]
        ax.plot([position[v] for v in values], best, "o-", color="C1", label="best at this value")
        if not numeric:
            ax.set_xticks(range(len(values)), [str(v) for v in values])
        ax.set_xlabel(name)
        ax.set_ylabel("score")
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = folder / "plots" / f"score_{name}.png"
        path.parent.mkdir(exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)
    return made


def _order(value: Any) -> tuple[int, Any]:
    return (0, value) if isinstance(value, int | float) and not isinstance(value, bool) else (1, str(value))
