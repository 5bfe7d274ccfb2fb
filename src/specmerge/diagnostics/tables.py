"""The report folder of ``specmerge inspect``: what the run collected, the tables (CSV, JSON) and ``report.md``.

Files (names fixed here and in :data:`PLOTS`):

- ``layers.csv`` / ``layers.json``: one row per inspected 2-D layer (CSV: floats to 6 significant digits,
  the per-expert relative norms as ``rel_norm[<expert>]`` columns; JSON: the rows as collected).
- ``summary.json``: the per-model table (paper App. C), the optimizer-as-filter fits, inputs, options, timings.
- ``optimizer_filter.csv``, ``filters.csv``: the fits per step count, the filters h_k on the WUDI layer.
- ``report.md``: the tables, the plots (drawn by :mod:`specmerge.diagnostics.plots`) and the per-layer table.

JSON is strict: non-finite floats are written as the strings ``"inf"`` / ``"nan"``.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specmerge.diagnostics.method_specs import MethodSpec
from specmerge.diagnostics.optimizer_filter import FilterFit
from specmerge.diagnostics.options import InspectOptions
from specmerge.diagnostics.statistics import RULE_LABELS, RULES, summarize_layers
from specmerge.pipeline.recipe.model import Recipe
from specmerge.version import __version__

# The plots of the report and their file names (drawn by :func:`specmerge.diagnostics.plots.write_plots`).
PLOTS = {
    "spectra": "spectra.png",
    "kept_ranks": "kept_ranks.png",
    "filter_shapes": "filter_shapes.png",
    "delta_norms": "delta_norms.png",
    "optimizer_filter": "optimizer_filter.png",
}


@dataclass
class InspectState:
    """What the report needs after streaming: scalar rows, a few spectra, the WUDI-layer diagnostics.

    ``rows``: one dict per inspected layer (the ``layers.json`` rows); ``spectra``: the full eigenvalue
    spectrum and kept ranks of the representative layers, by name; ``filters``: the WUDI layer's name,
    eigenvalues, filter gains h_k by filter and the eigenvalues of the fitted directions (None when the
    diagnostic is off or the layer is unchanged); ``fits``: the optimizer-as-filter fits in run order.
    """

    rows: list[dict[str, Any]] = field(default_factory=list)
    spectra: dict[str, dict[str, Any]] = field(default_factory=dict)
    filters: dict[str, Any] | None = None
    fits: list[FilterFit] = field(default_factory=list)


def summarize(
    recipe: Recipe,
    opts: InspectOptions,
    specs: Sequence[MethodSpec],
    state: InspectState,
    skipped: Sequence[str],
    wudi_layer: str | None,
    seconds: float,
    device: torch.device,
) -> dict[str, Any]:
    """The content of ``summary.json`` (without the thread fields, which the run adds)."""
    norms = {
        spec.label: math.sqrt(sum(r[f"norm[{spec.label}]"] ** 2 for r in state.rows)) for spec in specs
    }  # whole-model ||delta||_F over the inspected layers
    return {
        "specmerge": __version__,
        "base": recipe.base,
        "experts": dict(zip(recipe.expert_keys, recipe.experts, strict=True)),
        "options": opts.model_dump(),
        "device": str(device),
        "seconds": round(seconds, 3),
        "layers_inspected": len(state.rows),
        "routes": {route: sum(r["route"] == route for r in state.rows) for route in ("dense", "factored")},
        "skipped_not_in_experts": skipped,
        "summary": summarize_layers(state.rows),
        "model_delta_norms": norms,
        "wudi_layer": wudi_layer,
        "optimizer_filter": [fit.row() for fit in state.fits],
    }


def _csv_value(value: Any) -> Any:
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


def _json_safe(value: Any) -> Any:
    """Non-finite floats as strings ('inf', 'nan'): strict JSON has no Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def flat_row(row: dict[str, Any], expert_keys: Sequence[str]) -> dict[str, Any]:
    """A layer row with the per-expert relative norms as columns ``rel_norm[<expert>]``."""
    flat = {k: v for k, v in row.items() if k != "rel_norms"}
    for key, value in zip(expert_keys, row.get("rel_norms", []), strict=False):
        flat[f"rel_norm[{key}]"] = value
    return flat


def _write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(v) for k, v in row.items()})


def write_tables(folder: Path, state: InspectState, expert_keys: Sequence[str], summary: dict[str, Any]) -> None:
    """Write layers.csv, layers.json, summary.json and, when collected, optimizer_filter.csv and filters.csv."""
    _write_csv(folder / "layers.csv", [flat_row(r, expert_keys) for r in state.rows])
    (folder / "layers.json").write_text(json.dumps(_json_safe(state.rows), indent=1))
    (folder / "summary.json").write_text(json.dumps(_json_safe(summary), indent=1))
    if state.fits:
        _write_csv(folder / "optimizer_filter.csv", [fit.row() for fit in state.fits])
    if state.filters is not None:
        lam = state.filters["eigenvalues"]
        rows = [
            {"k": k + 1, "lambda": float(lam[k]), **{n: float(g[k]) for n, g in state.filters["gains"].items()}}
            for k in range(lam.numel())
        ]
        _write_csv(folder / "filters.csv", rows)


# ---------------------------------------------------------------------------------------------
# report.md

SUMMARY_ROWS = (
    ("# linear layers", "n_layers", "d"),
    ("‖tau_i‖_F / ‖W_0‖_F (mean over i, layers)", "mean_update_magnitude", ".4f"),
    ("Effective-rank ratio r_eff / d_in (mean)", "effective_rank_ratio", ".3f"),
    ("lambda_max / lambda_med (median)", "median_max_over_median", ".3g"),
    ("lambda_90 / lambda_max (median)", "median_l90_over_max", ".2e"),
    ("Layer-wise CV of lambda_max", "cv_lambda_max", ".3f"),
    ("SWUDI-A psqrt mean K / d_in", "psqrt_mean_K_ratio", ".3f"),
)


def fmt(value: Any, spec: str) -> str:
    """A number for a Markdown table ('-' for None)."""
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return format(value, spec)


def summary_table(summary: dict[str, Any]) -> list[str]:
    """The per-architecture table (paper App. C) as Markdown lines."""
    s = summary["summary"]
    lines = ["| Statistic | Value |", "|---|---|"]
    lines += [f"| {label} | {fmt(s[key], spec)} |" for label, key, spec in SUMMARY_ROWS]
    lines.append(f"| SWUDI-A psqrt min/median/max K | {s['psqrt_K_min']}/{s['psqrt_K_median']:g}/{s['psqrt_K_max']} |")
    lines.append(
        f"| (not in the paper) lambda_max / smallest non-zero lambda (median) | "
        f"{fmt(s['median_condition_on_range'], '.3g')} |"
    )
    return lines


def render_report(summary: dict[str, Any], state: InspectState, specs: Sequence[MethodSpec], plots: bool) -> str:
    """report.md: inputs, the summary table, rank rules, optimizer fits, plots, per-layer table."""
    s, opts = summary["summary"], summary["options"]
    lines = [
        "# specmerge inspect report",
        "",
        f"Base: `{summary['base']}`  ",
        f"Experts ({len(summary['experts'])}): " + ", ".join(f"`{k}`" for k in summary["experts"]) + "  ",
        f"{summary['layers_inspected']} 2-D linear layers ({summary['routes']['dense']} dense, "
        f"{summary['routes']['factored']} LoRA factored) in {summary['seconds']:.1f} s on {summary['device']}, "
        f"specmerge {summary['specmerge']}.",
        "",
    ]
    if summary["skipped_not_in_experts"]:
        lines += [f"Base tensors no expert holds (skipped): {', '.join(summary['skipped_not_in_experts'])}.", ""]
    lines += ["## Summary (as the paper's per-architecture table, App. C)", "", *summary_table(summary), ""]
    lines += [
        "r_eff is the eigenvalue participation ratio (sum lambda)^2 / sum lambda^2; all d_in eigenvalues of C count "
        "(structural zeros included); eigenvalues below the solver's tolerance are exact zeros.",
        "",
        "## Rank rules",
        "",
        f"Kept rank K and the share of the WUDI proxy reduction (pseudoinverse = 1) kept by the cut, from tau_init = "
        f"{opts['tau_init']}; fixed ratio r = {opts['rank_ratio']:g}.",
        "",
        "| Rule | mean K / d_in | median share of proxy reduction |",
        "|---|---|---|",
    ]
    lines += [
        f"| {RULE_LABELS[r]} | {fmt(s[f'{r}_mean_K_ratio'], '.3f')} | {fmt(s[f'{r}_median_share'], '.4f')} |"
        for r in RULES
    ]
    lines += ["", "## Merged-delta norms (norm-shortcut diagnostic)", "", "| Method | whole-model norm |", "|---|---|"]
    lines += [f"| {label} | {fmt(v, '.4g')} |" for label, v in summary["model_delta_norms"].items()]
    lines += ["", *_optimizer_section(summary), ""]
    if plots:
        lines += ["## Plots", ""]
        for key, title in (
            ("spectra", "Eigen-spectra with the psqrt and Gavish-Donoho cuts"),
            ("kept_ranks", "Kept-rank ratio by layer type"),
            ("filter_shapes", "Filter shapes on the WUDI layer"),
            ("delta_norms", "Merged-delta norm per method"),
            ("optimizer_filter", "Optimizer as filter"),
        ):
            lines += [f"### {title}", "", f"![{title}]({PLOTS[key]})", ""]
    lines += ["## Per layer", "", *_layer_table(state.rows, specs)]
    return "\n".join(lines) + "\n"


def _optimizer_section(summary: dict[str, Any]) -> list[str]:
    fits = summary["optimizer_filter"]
    if not fits:
        return []
    opts = summary["options"]
    lines = [
        "## Optimizer as filter (iterative WUDI)",
        "",
        f"Layer `{summary['wudi_layer']}`, start tau_init = {opts['wudi_init']}, float64. Empirical filter "
        "h_k = lambda_k <(tau_n - tau_init) q_k, B q_k> / ||B q_k||^2; Landweber fitted with eta = 2 lr "
        "(a step of size lr on the WUDI loss), exponential with free t.",
        "",
        "R2 is nan once the filter is flat (saturated at 1: no spread left to explain); the RMSE still applies.",
        "",
        "| Optimizer | lr | step | t_eff | R2 exponential | RMSE exp. | n_eff | R2 Landweber | RMSE Landweber |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {f['optimizer']} | {f['lr']:.3g} | {f['step']} | {fmt(f['t_eff'], '.4g')} | "
        f"{fmt(f['r2_exponential'], '.6f')} | {fmt(f['rmse_exponential'], '.2e')} | {fmt(f['n_eff'], '.5g')} | "
        f"{fmt(f['r2_landweber'], '.6f')} | {fmt(f['rmse_landweber'], '.2e')} |"
        for f in fits
    ]
    return lines


def _layer_table(rows: Sequence[dict[str, Any]], specs: Sequence[MethodSpec], limit: int = 200) -> list[str]:
    head = ["layer", "d_out x d_in", "mean rel. norm", "r_eff/d_in", "lmax/lmed", "l90/lmax", "K psqrt", "K GD"]
    head += [f"norm {s.label}" for s in specs[:4]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows[:limit]:
        if r.get("n_nonzero", 0) == 0:
            lines.append(f"| {r['name']} | {r['d_out']}x{r['d_in']} | 0 (no expert changes it) |" + " |" * 9)
            continue
        rel = [v for v in r["rel_norms"] if v > 0]
        cells = [
            r["name"],
            f"{r['d_out']}x{r['d_in']}",
            fmt(sum(rel) / len(rel), ".4f"),
            fmt(r["r_eff_participation"] / r["d_in"], ".3f"),
            fmt(r["max_over_median"], ".3g"),
            fmt(r["l90_over_max"], ".2e"),
            str(r["K_psqrt"]),
            str(r["K_gavish_donoho"]),
        ]
        cells += [fmt(r[f"norm[{s.label}]"], ".4g") for s in specs[:4]]
        lines.append("| " + " | ".join(cells) + " |")
    if len(rows) > limit:
        lines.append(f"\n{len(rows) - limit} more layers in layers.csv.")
    return lines
