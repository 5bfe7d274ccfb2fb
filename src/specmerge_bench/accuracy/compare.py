"""The accuracy benchmark's settings side by side: one table, the paper's claims as paired differences, two plots.

Each setting is a results folder of ``specmerge-bench accuracy`` (``results.json``: the summary over seeds and each
seed's rows). A claim is a difference between two rows' average test accuracy, paired by seed (the same experts
under both methods), reported as its mean and sample std over the seeds next to the two rows' own seed stds, so a
difference can be read against the spread of the seeds. ``bench/accuracy_settings.py`` is the command.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from specmerge_bench.accuracy.report import FIXED_TITLES, exact_mean, seed_stats, summarize
from specmerge_bench.accuracy.rows import CLAIMS, WUDI_STEPS

SWEEP = tuple(f"wudi_{steps}" for steps in WUDI_STEPS)


class ResultsError(ValueError):
    """A results folder that cannot be read (one line, naming the file)."""


def load_results(folder: Path) -> dict[str, Any]:
    """``folder/results.json`` as ``specmerge-bench accuracy`` wrote it."""
    path = Path(folder) / "results.json"
    if not path.is_file():
        raise ResultsError(f"{path} does not exist (give a folder under CACHE/results/ of specmerge-bench accuracy)")
    try:
        results = json.loads(path.read_text())
        if not (isinstance(results["summary"]["rows"], dict) and isinstance(results["per_seed"][0]["rows"], dict)):
            raise TypeError("rows are not a mapping")
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise ResultsError(f"{path} is not a results file of specmerge-bench accuracy ({exc!r})") from None
    seeds = re.search(r"-seeds-([0-9-]+)$", Path(folder).resolve().name)
    named = [int(k) for k in seeds[1].split("-")] if seeds else [None] * len(results["per_seed"])
    if len(named) == len(results["per_seed"]):  # results written before each seed recorded its number
        results["per_seed"] = [{"seed": k, **s} for k, s in zip(named, results["per_seed"], strict=True)]
    return results


def load_setting(paths: Sequence[Path]) -> dict[str, Any]:
    """One setting's results from several runs: results folders and score files (a stopped run's finished rows,
    :func:`specmerge_bench.accuracy.keep.seed_from_scores`), their seeds pooled on the rows every seed has."""
    from specmerge_bench.accuracy.keep import pool_seeds, seed_from_scores

    per_seed: list[dict[str, Any]] = []
    for path in paths:
        if not Path(path).exists():
            raise ResultsError(f"{path} does not exist (give a results folder or a score file of specmerge-bench "
                               "accuracy)")  # fmt: skip
        if Path(path).is_dir():
            per_seed += load_results(path)["per_seed"]
            continue
        try:
            per_seed.append(seed_from_scores(path))
        except ValueError as err:  # KeepError, or a record that is not a JSON object
            raise ResultsError(str(err)) from None
    seeds = [s.get("seed") for s in per_seed if s.get("seed") is not None]
    if len(set(seeds)) < len(seeds):
        raise ResultsError(f"{', '.join(map(str, paths))}: seed {max(seeds, key=seeds.count)} is given twice")
    if len({s.get("track", "full") for s in per_seed}) > 1:
        raise ResultsError(f"{', '.join(map(str, paths))}: full and LoRA runs mixed in one setting")
    if any(sorted(s["tasks"]) != sorted(per_seed[0]["tasks"]) for s in per_seed):
        raise ResultsError(f"{', '.join(map(str, paths))}: the runs have different task sets")
    pooled = pool_seeds(per_seed)
    return {"summary": summarize(pooled), "per_seed": pooled}


def _seeds(results: Mapping[str, Any]) -> str:
    count = results["summary"]["seeds"]
    return f"{count} seed{'s' if count > 1 else ''}"


def _title(settings: Mapping[str, Mapping[str, Any]], label: str) -> str:
    """A row's title, from the first setting that has the row (``base`` and ``experts``: their fixed titles)."""
    if label in FIXED_TITLES:
        return FIXED_TITLES[label]
    rows = (results["summary"]["rows"] for results in settings.values())
    return next((r[label]["title"] for r in rows if label in r), label)


def average(seed: Mapping[str, Any], label: str, tasks: Sequence[str] | None = None) -> float:
    """A row's average test accuracy over ``tasks`` (default: all the seed's tasks) in one seed; ``experts``: each
    task's own expert's; ``base``: the base model's."""
    tasks = seed["tasks"] if tasks is None else tasks
    if label == "experts":
        test = {t: seed["experts"][t]["test"] for t in tasks}
    else:
        test = seed["base"]["test"] if label == "base" else seed["rows"][label]["test"]
    return exact_mean([test[t] for t in tasks])


def differences(results: Mapping[str, Any], row: str, against: str) -> list[float] | None:
    """Per seed, ``row``'s average test accuracy minus ``against``'s; None if a seed lacks either row."""
    seeds = results["per_seed"]
    if any(label not in seed["rows"] for seed in seeds for label in (row, against)):
        return None
    return [average(seed, row) - average(seed, against) for seed in seeds]


def paired(results: Mapping[str, Any], row: str, against: str) -> dict[str, float] | None:
    """Mean and std over seeds of ``row``'s average test accuracy minus ``against``'s; None if a row is missing."""
    diffs = differences(results, row, against)
    return None if diffs is None else seed_stats(diffs)


def sweep_peak(results: Mapping[str, Any]) -> tuple[int, float, int, float] | None:
    """The WUDI step count with the best mean average accuracy and that accuracy; the longest step count scored (a
    stopped run may lack the last ones) and its accuracy."""
    rows = results["summary"]["rows"]
    present = [(steps, rows[f"wudi_{steps}"]["average"]["mean"]) for steps in WUDI_STEPS if f"wudi_{steps}" in rows]
    if not present:
        return None
    best = max(present, key=lambda item: item[1])
    return (*best, *present[-1])


def shared_tasks(small: Mapping[str, Any], large: Mapping[str, Any]) -> dict[str, dict[str, Any]] | None:
    """How each row does on ``small``'s tasks when merged with ``large``'s further tasks: per row, both settings'
    average test accuracy over ``small``'s tasks on the seeds both have, and their paired difference (large - small)
    as mean and std over those seeds. None unless ``small``'s tasks are a proper subset of ``large``'s, the track is
    the same and a seed is shared (the same seed trains the same expert for a task in both settings)."""
    first = small["per_seed"][0], large["per_seed"][0]
    tasks = sorted(first[0]["tasks"])
    if not set(tasks) < set(first[1]["tasks"]) or first[0].get("track", "full") != first[1].get("track", "full"):
        return None
    by_seed = [{s["seed"]: s for s in r["per_seed"] if s.get("seed") is not None} for r in (small, large)]
    seeds = sorted(set(by_seed[0]) & set(by_seed[1]))
    if not seeds:
        return None
    out = {}
    for label in ["experts", *first[0]["rows"]]:
        if label != "experts" and any(label not in by[k]["rows"] for by in by_seed for k in seeds):
            continue
        pairs = [(average(by_seed[0][k], label, tasks), average(by_seed[1][k], label, tasks)) for k in seeds]
        out[label] = {"small": seed_stats([a for a, _ in pairs]), "large": seed_stats([b for _, b in pairs]),
                      "diff": seed_stats([b - a for a, b in pairs]), "seeds": seeds}  # fmt: skip
    return out


def _cell(figure: Mapping[str, float], seeds: int, digits: int = 1, sign: str = "") -> str:
    """``mean ± std`` in points; the mean alone for one seed (a std over one seed says nothing)."""
    mean = f"{100 * figure['mean']:{sign}.{digits}f}"
    return mean if seeds < 2 else f"{mean} ± {100 * figure['std']:.{digits}f}"


def _shared_markdown(settings: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """A table per pair of settings where one's tasks are a proper subset of the other's (:func:`shared_tasks`)."""
    lines: list[str] = []
    for small_name, small in settings.items():
        for large_name, large in settings.items():
            table = shared_tasks(small, large)
            if not table:
                continue
            seeds = next(iter(table.values()))["seeds"]
            n = len(small["per_seed"][0]["tasks"])
            lines += ["", f"On the {n} tasks of {small_name}, merged alone and within {large_name} (average test "
                      f"accuracy over those {n} tasks, seeds {', '.join(map(str, seeds))}; the change is paired by "
                      "seed):", "", f"| method | {small_name} | {large_name} | change |",
                      "|---|---:|---:|---:|"]  # fmt: skip
            for label, figure in table.items():
                cells = [_cell(figure[k], len(seeds)) for k in ("small", "large")]
                lines.append(
                    f"| {_title(settings, label)} | {' | '.join(cells)} | {_cell(figure['diff'], len(seeds), 2, '+')} |"
                )
    return lines


def markdown(settings: Mapping[str, Mapping[str, Any]]) -> str:
    """The table of every row in every setting (average test accuracy, mean ± std over seeds, in %) and the claims."""
    names = list(settings)

    lines = ["| method | " + " | ".join(f"{name} ({_seeds(settings[name])})" for name in names)
             + " |", "|---" + "|---:" * len(names) + "|"]  # fmt: skip
    titles: dict[str, str] = dict(FIXED_TITLES)
    for results in settings.values():
        titles.update({k: r["title"] for k, r in results["summary"]["rows"].items() if k not in SWEEP})
    for label, title in titles.items():
        cells = []
        for results in settings.values():
            summary = results["summary"]
            figure = summary.get(label) or summary["rows"].get(label)
            cells.append(_cell(figure["average"], summary["seeds"]) if figure else "–")
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    lines += ["", "Paired differences (points; mean ± std over seeds of the per-seed difference; in brackets the two "
              "rows' own seed stds):", "", "| difference | " + " | ".join(names) + " |",
              "|---" + "|---:" * len(names) + "|"]  # fmt: skip
    for row, against in CLAIMS:
        cells = []
        for results in settings.values():
            diff, rows = paired(results, row, against), results["summary"]["rows"]
            if diff is None:
                cells.append("–")
                continue
            own = "/".join(f"{100 * rows[k]['average']['std']:.1f}" for k in (row, against))
            seeds = results["summary"]["seeds"]
            cells.append(_cell(diff, seeds, 2, "+") + (f" ({own})" if seeds > 1 else ""))
        lines.append(f"| {_title(settings, row)} − {_title(settings, against)} | " + " | ".join(cells) + " |")
    lines += ["", "| WUDI step sweep | " + " | ".join(names) + " |", "|---" + "|---:" * len(names) + "|"]
    peaks = [sweep_peak(results) for results in settings.values()]
    lines.append("| best step count (its avg acc) | " + " | ".join(
        f"{p[0]} ({100 * p[1]:.1f})" if p else "–" for p in peaks) + " |")  # fmt: skip
    lines.append("| longest run scored (its avg acc) | " + " | ".join(
        f"{p[2]} ({100 * p[3]:.1f})" if p else "–" for p in peaks) + " |")  # fmt: skip
    lines += _shared_markdown(settings)
    return "\n".join(lines) + "\n"


def _same_or_each(values: Sequence[str]) -> str:
    """One value when every seed has it, else each seed's, ``a / b / c``."""
    return values[0] if len(set(values)) == 1 else " / ".join(values)


def per_seed_markdown(name: str, results: Mapping[str, Any]) -> str:
    """One setting seed by seed: every row's average test accuracy per seed (two decimals), mean ± std and the
    setting each seed chose on val; the paper's claims per seed, paired, and in how many seeds each holds; the WUDI
    step sweep per seed."""
    seeds, summary = results["per_seed"], results["summary"]
    n, named = len(seeds), " / ".join(str(s.get("seed")) for s in seeds)
    columns = " | ".join(f"seed {s.get('seed')}" for s in seeds)
    rule = "|---" + "|---:" * (n + 1)

    def per_seed(label: str) -> list[float]:
        return [100 * average(seed, label) for seed in seeds]

    def chosen(label: str) -> str:  # the parameters chosen (``swudi(rank_ratio=0.55, t=800.0)``: inside the brackets)
        rows = [seed["rows"][label] for seed in seeds]
        params = [re.sub(r"^[\w.]+\((.*)\)$", r"\1", row["choice"]) for row in rows]
        return _same_or_each([f"{p}, s={row['scale']}".lstrip(", ") for p, row in zip(params, rows, strict=True)])

    lines = [f"{name}, seed by seed (average test accuracy over the tasks, %; each row's setting chosen on val):", "",
             f"| method | {columns} | mean ± std | chosen on val (seeds {named}) |", rule + "|---|"]  # fmt: skip
    for label, title in FIXED_TITLES.items():
        cells = " | ".join(f"{v:.2f}" for v in per_seed(label))
        lines.append(f"| {title} | {cells} | {_cell(summary[label]['average'], n)} | |")
    for label, row in summary["rows"].items():
        if label in SWEEP or "anchor" in row:
            continue
        cells = " | ".join(f"{v:.2f}" for v in per_seed(label))
        lines.append(f"| {row['title']} | {cells} | {_cell(row['average'], n)} | {chosen(label)} |")
    lines += ["", f"The paper's claims in {name}, seed by seed (points; paired: mean ± std over seeds of the per-seed "
              "difference, the two rows' own seed stds in brackets):", "",
              f"| claim | {columns} | paired | holds in |", rule + "|---:|"]  # fmt: skip
    rows = summary["rows"]
    for row, against in CLAIMS:
        diffs = differences(results, row, against)
        if diffs is None:
            continue
        own = "/".join(f"{100 * rows[k]['average']['std']:.1f}" for k in (row, against))
        pair = _cell(seed_stats(diffs), n, 2, "+") + (f" ({own})" if n > 1 else "")
        cells = " | ".join(f"{100 * d:+.2f}" for d in diffs)
        holds = sum(d > 0 for d in diffs)
        lines.append(f"| {rows[row]['title']} > {rows[against]['title']} | {cells} | {pair} | {holds} of {n} seeds |")
    sweep = [label for label in SWEEP if all(label in seed["rows"] for seed in seeds)]
    if sweep:
        lines += ["", f"The WUDI step sweep in {name}, seed by seed (Adam, lr 1e-5, from tau_init = sum; one run per "
                  "seed with snapshots, s chosen on val at each step count):", "",
                  f"| WUDI steps | {columns} | mean ± std | s (seeds {named}) |", rule + "|---:|"]  # fmt: skip
        for label in [*sweep, "closed_form"]:
            cells = " | ".join(f"{v:.2f}" for v in per_seed(label))
            scales = _same_or_each([str(seed["rows"][label]["scale"]) for seed in seeds])
            lines.append(f"| {rows[label]['title']} | {cells} | {_cell(rows[label]['average'], n, 2)} | {scales} |")
    return "\n".join(lines) + "\n"


def plots(settings: Mapping[str, Mapping[str, Any]], folder: Path) -> list[Path]:
    """``accuracy-settings.png`` (one panel per setting: each row's average test accuracy, mean ± std over seeds,
    with the base and experts lines) and ``wudi-steps-settings.png`` (the step sweeps as the share of the base ->
    experts gap closed, so settings of different accuracy share an axis; D C⁺ and SWUDI-A dashed and dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    # every row of any setting, in the order the settings first name them (a stopped run may have none yet)
    order = list(dict.fromkeys(k for r in settings.values() for k in r["summary"]["rows"] if k not in SWEEP))
    fig, axes = plt.subplots(1, len(settings), figsize=(4.2 * len(settings) + 2.5, 0.33 * len(order) + 1.6),
                             sharey=True, squeeze=False)  # fmt: skip
    titles = [_title(settings, k) for k in order]
    for ax, (name, results) in zip(axes[0], settings.items(), strict=True):
        summary = results["summary"]
        figs = [summary["rows"].get(k, {}).get("average") for k in order]
        means = [100 * f["mean"] if f else math.nan for f in figs]
        ax.barh(titles, means, xerr=[100 * f["std"] if f else 0 for f in figs], color="tab:blue", alpha=0.8)
        for key, style in (("base", "--"), ("experts", ":")):
            ax.axvline(100 * summary[key]["average"]["mean"], color="k", linestyle=style, label=key)
        low = min([100 * summary["base"]["average"]["mean"], *(m for m in means if not math.isnan(m))]) - 2
        ax.set_xlim(low, 100 * summary["experts"]["average"]["mean"] + 1)
        ax.set_title(f"{name}, {_seeds(results)}", fontsize=10)
        ax.set_xlabel(f"avg test accuracy, {len(summary['tasks'])} tasks (%)")
    axes[0][0].invert_yaxis()
    axes[0][-1].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    out = [folder / "accuracy-settings.png"]
    fig.savefig(out[0], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, (name, results) in enumerate(settings.items()):
        rows, color = results["summary"]["rows"], f"C{i}"
        steps = [s for s in WUDI_STEPS if f"wudi_{s}" in rows]
        gap = [rows[f"wudi_{s}"]["gap_closed"] for s in steps]
        ax.errorbar(steps, [100 * g["mean"] for g in gap], yerr=[100 * g["std"] for g in gap], marker="o",
                    color=color, label=f"{name}: WUDI")  # fmt: skip
        for key, style in (("closed_form", "--"), ("swudi_a_psqrt", ":")):
            if key in rows:
                ax.axhline(100 * rows[key]["gap_closed"]["mean"], color=color, linestyle=style, linewidth=1)
    ax.plot([], [], "k--", linewidth=1, label="D C⁺ (each setting's colour)")
    ax.plot([], [], "k:", linewidth=1, label="SWUDI-A psqrt")
    ax.set_xscale("log")
    ax.set_xlabel("WUDI optimizer steps (log scale)")
    ax.set_ylabel("base → experts gap closed (%)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.append(folder / "wudi-steps-settings.png")
    fig.savefig(out[1], dpi=110)
    plt.close(fig)
    return out
