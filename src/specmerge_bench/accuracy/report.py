"""Tables and plots of the accuracy benchmark: mean and std over seeds of each row's test accuracy.

Reported per row: average test accuracy over the tasks, normalised accuracy (mean over tasks of merged /
expert accuracy) and gap closed (mean over tasks of (merged - base) / (expert - base)), and the per-task
accuracies; for an AdaMerging row also its change over the merge it starts from (its anchor row), signed.
``results.md`` holds the main table, the AdaMerging table, the WUDI step sweep and the settings chosen per seed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from specmerge_bench.accuracy.rows import step_rows

# The two reference rows every table starts with (not methods, so not in the row registry).
FIXED_TITLES = {"base": "Base model (probe heads)", "experts": "Individual experts"}


def exact_mean(values: Sequence[float]) -> float:
    """Exactly rounded mean: independent of the order of ``values`` (a score read back from the cache lists
    its tasks in another order than a fresh one, and settings with equal validation scores must tie exactly)."""
    return math.fsum(values) / len(values)


def seed_stats(values: Sequence[float]) -> dict[str, float]:
    """Mean and sample standard deviation over seeds (0 for one seed; nan stays nan: a task whose expert equals the
    base)."""
    mean = exact_mean(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
    return {"mean": mean, "std": math.sqrt(var)}


def summarize(per_seed: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Mean and std over seeds of average accuracy, normalised accuracy and gap closed, per row; for an AdaMerging
    row (one with an ``anchor``) also of its change in average accuracy over the anchor and of its mean entropy
    before and after."""
    tasks = per_seed[0]["tasks"]

    def figures(test_of: Callable[[Mapping[str, Any]], Mapping[str, float]]) -> dict[str, Any]:
        avg, norm, gap = [], [], []
        per_task: dict[str, list[float]] = {t: [] for t in tasks}
        for seed in per_seed:
            test = test_of(seed)
            expert = {t: seed["experts"][t]["test"] for t in tasks}
            base = seed["base"]["test"]
            avg.append(exact_mean([test[t] for t in tasks]))
            norm.append(exact_mean([test[t] / expert[t] for t in tasks]))
            gap.append(exact_mean([(test[t] - base[t]) / (expert[t] - base[t]) if expert[t] != base[t] else math.nan
                              for t in tasks]))  # fmt: skip
            for t in tasks:
                per_task[t].append(test[t])
        return {"average": seed_stats(avg), "normalised": seed_stats(norm), "gap_closed": seed_stats(gap),
                "per_task": {t: seed_stats(v) for t, v in per_task.items()}}  # fmt: skip

    summary = {
        "seeds": len(per_seed),
        "tasks": tasks,
        "base": figures(lambda s: s["base"]["test"]),
        "experts": figures(lambda s: {t: s["experts"][t]["test"] for t in tasks}),
        "rows": {},
    }
    for label, row in per_seed[0]["rows"].items():
        summary["rows"][label] = {
            "title": row["title"],
            **figures(lambda s, lab=label: s["rows"][lab]["test"]),
            "choices": [f"{s['rows'][label]['choice']}, s={s['rows'][label]['scale']}" for s in per_seed],
        }
        if "anchor" in row:
            anchor = row["anchor"]
            change = [exact_mean([s["rows"][label]["test"][t] - s["rows"][anchor]["test"][t] for t in tasks])
                      for s in per_seed]  # fmt: skip
            entropy = [s["rows"][label]["entropy"] for s in per_seed]
            summary["rows"][label].update({"anchor": anchor, "change": seed_stats(change),
                                           "entropy": {"start": seed_stats([e[0] for e in entropy]),
                                                       "end": seed_stats([e[1] for e in entropy])}})  # fmt: skip
    return summary


def markdown(summary: Mapping[str, Any]) -> str:
    """The results tables (main and WUDI step sweep) as Markdown, accuracies in percent."""
    tasks = summary["tasks"]

    def pm(stat: Mapping[str, float], factor: float = 100.0) -> str:
        return f"{factor * stat['mean']:.1f} ± {factor * stat['std']:.1f}"

    head = "| method | avg acc | normalised | gap closed | " + " | ".join(tasks) + " |"
    lines = [head, "|---" + "|---:" * (3 + len(tasks)) + "|"]

    def line(title: str, fig: Mapping[str, Any]) -> str:
        cells = [pm(fig["average"]), pm(fig["normalised"]), pm(fig["gap_closed"])]
        cells += [f"{100 * fig['per_task'][t]['mean']:.1f}" for t in tasks]
        return f"| {title} | " + " | ".join(cells) + " |"

    lines += [line(title, summary[label]) for label, title in FIXED_TITLES.items()]
    sweep = {r.label for r in step_rows()}
    for label, row in summary["rows"].items():
        if label not in sweep or label == "closed_form":
            lines.append(line(row["title"], row))
    adapted = {label: row for label, row in summary["rows"].items() if "anchor" in row}
    if adapted:
        lines += ["", "AdaMerging on the unlabeled test inputs, from the merge its anchor row chose on val (change: "
                  "average accuracy minus the anchor's, in points):", "",
                  "| method | starts from | start avg acc | avg acc | change | mean entropy, start → end |",
                  "|---|---|---:|---:|---:|---:|"]  # fmt: skip
        for row in adapted.values():
            anchor, change, entropy = summary["rows"][row["anchor"]], row["change"], row["entropy"]
            lines.append(f"| {row['title']} | {anchor['title']} | {pm(anchor['average'])} | {pm(row['average'])} | "
                         f"{100 * change['mean']:+.2f} ± {100 * change['std']:.2f} | "
                         f"{entropy['start']['mean']:.4f} → {entropy['end']['mean']:.4f} |")  # fmt: skip
    lines += ["", "| WUDI steps | avg acc | gap closed |", "|---|---:|---:|"]
    for r in step_rows():
        row = summary["rows"][r.label]
        lines.append(f"| {row['title']} | {pm(row['average'])} | {pm(row['gap_closed'])} |")
    lines += ["", "Chosen settings (per seed):", ""]
    for row in summary["rows"].values():
        lines.append(f"- {row['title']}: " + "; ".join(row["choices"]))
    return "\n".join(lines) + "\n"


def plots(summary: Mapping[str, Any], folder: Path) -> list[Path]:
    """accuracy.png (average accuracy per method, mean ± std over seeds) and wudi_steps.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = {r.label for r in step_rows()} - {"closed_form"}
    rows = [(r["title"], r["average"]) for lab, r in summary["rows"].items() if lab not in sweep]
    rows.sort(key=lambda x: x[1]["mean"])
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.5))
    ax.barh([t for t, _ in rows], [100 * s["mean"] for _, s in rows], xerr=[100 * s["std"] for _, s in rows],
            color="tab:blue", alpha=0.8)  # fmt: skip
    for value, name, style in ((summary["base"], "base", "--"), (summary["experts"], "experts", ":")):
        ax.axvline(100 * value["average"]["mean"], color="k", linestyle=style, label=f"{name} (avg)")
    low = min(100 * summary["base"]["average"]["mean"], *(100 * s["mean"] for _, s in rows)) - 3
    ax.set_xlim(low, 100 * summary["experts"]["average"]["mean"] + 1)
    seeds = f"{summary['seeds']} seed{'s' if summary['seeds'] > 1 else ''}"
    ax.set_xlabel(f"average test accuracy over {len(summary['tasks'])} tasks (%), mean ± std of {seeds}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    out = [folder / "accuracy.png"]
    fig.savefig(out[0], dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [r.label for r in step_rows() if r.label != "closed_form"]
    x = [int(label.split("_")[1]) for label in labels]
    y = [100 * summary["rows"][lab]["average"]["mean"] for lab in labels]
    e = [100 * summary["rows"][lab]["average"]["std"] for lab in labels]
    ax.errorbar(x, y, yerr=e, marker="o", label="WUDI (Adam, lr 1e-5)")
    closed = summary["rows"]["closed_form"]["average"]
    ax.axhline(100 * closed["mean"], color="tab:red", linestyle="--", label="D C⁺ (closed form)")
    ax.set_xscale("log")  # the sweep runs from 100 to thousands of steps
    ax.set_xlabel("WUDI optimizer steps (log scale)")
    ax.set_ylabel("average test accuracy (%)")
    ax.legend()
    fig.tight_layout()
    out.append(folder / "wudi_steps.png")
    fig.savefig(out[1], dpi=120)
    plt.close(fig)
    return out
