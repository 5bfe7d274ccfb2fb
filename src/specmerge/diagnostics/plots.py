"""The figures of the ``specmerge inspect`` report, drawn with matplotlib (an optional dependency) as PNG files.

- ``spectra.png``: eigen-spectra of C for representative layers, with the psqrt and Gavish-Donoho cuts;
- ``kept_ranks.png``: the mean kept-rank ratio K / d_in by layer type and rank rule;
- ``delta_norms.png``: each compared method's merged-delta norm per layer and over the model;
- ``filter_shapes.png``: the filters h_k and their inverse gains on the WUDI layer;
- ``optimizer_filter.png``: iterative WUDI's empirical filters (Adam, plain GD) with their fits, and R^2 vs steps.

Every function reads what :class:`specmerge.diagnostics.tables.InspectState` collected; nothing is recomputed.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specmerge.diagnostics.method_specs import MethodSpec
from specmerge.diagnostics.optimizer_filter import FilterFit
from specmerge.diagnostics.statistics import RULE_LABELS, RULES
from specmerge.diagnostics.tables import PLOTS, InspectState


def require_matplotlib() -> None:
    """Refuse with one line, before any work, when the plots are asked for and matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(
            "inspect draws its plots with matplotlib (optional): pip install 'specmerge[plots]' (or pass --no-plots)"
        ) from None


def write_plots(folder: Path, state: InspectState, specs: Sequence[MethodSpec], wudi_layer: str | None) -> None:
    """Draw every plot of the report into ``folder`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    _plot_spectra(folder / PLOTS["spectra"], state)
    _plot_kept_ranks(folder / PLOTS["kept_ranks"], state.rows)
    _plot_delta_norms(folder / PLOTS["delta_norms"], state.rows, specs)
    if state.filters is not None:
        _plot_filter_shapes(folder / PLOTS["filter_shapes"], state.filters)
    if state.fits:
        _plot_optimizer_filter(folder / PLOTS["optimizer_filter"], state.fits, state.filters, wudi_layer)


def _short(name: str, width: int = 48) -> str:
    name = name.removesuffix(".weight")
    return name if len(name) <= width else "..." + name[-(width - 3) :]


def _layered(count: int) -> list[float]:
    """Line widths from thick to thin, so that curves which coincide (e.g. every cut beyond the rank) stay visible."""
    return [1.2 + 2.4 * (count - 1 - i) / max(count - 1, 1) for i in range(count)]


def _plain_log_ticks(axis: Any, decades: float = 1.0) -> None:
    """Log-axis ticks written as plain numbers: at 1, 2, 5 x 10^k over up to 2 decades, else at powers of 10."""
    from matplotlib import ticker

    subs = (1.0, 2.0, 5.0) if decades <= 2 else (1.0,)
    axis.set_major_locator(ticker.LogLocator(base=10, subs=subs, numticks=30))
    axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(ticker.NullFormatter())


def _plot_spectra(path: Path, state: InspectState) -> None:
    import matplotlib.pyplot as plt

    names = [n for n in state.spectra if any(r["name"] == n for r in state.rows)]
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.9 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        s = state.spectra[name]
        lam = s["eigenvalues"]
        positive = lam[lam > 0]
        k = torch.arange(1, positive.numel() + 1)
        ax.semilogy(k, positive / positive[0], color="black", lw=1.4, label=r"$\lambda_k/\lambda_{max}$")
        for rule, style, color in (("psqrt", "--", "tab:blue"), ("gavish_donoho", ":", "tab:red")):
            K = s[f"K_{rule}"]
            ax.axvline(K, ls=style, color=color, lw=1.6, label=f"{RULE_LABELS[rule]}: K={K}")
        ax.set_title(f"{_short(name)}\n(d_in={lam.numel()}, {positive.numel()} non-zero)", fontsize=9)
        ax.set_xlabel("eigen-direction k (descending)")
        ax.set_ylabel(r"$\lambda_k / \lambda_{max}$ of C")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8, loc="lower left")
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    fig.suptitle("Eigen-spectra of C for representative layers, with the rank rules' cuts", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_kept_ranks(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    import matplotlib.pyplot as plt

    live = [r for r in rows if r.get("n_nonzero", 0) > 0]
    types = list(dict.fromkeys(r["type"] for r in live))
    width = 0.8 / len(RULES)
    fig, ax = plt.subplots(figsize=(max(6.5, 1.3 * len(types) + 2.5) + 3, 4.6))
    smallest = 1.0
    for j, rule in enumerate(RULES):
        means = [_mean_of(live, t, f"K_{rule}_ratio") for t in types]
        smallest = min([smallest, *(m for m in means if m > 0)])
        x = [i + (j - (len(RULES) - 1) / 2) * width for i in range(len(types))]
        ax.bar(x, means, width, label=RULE_LABELS[rule])
    ranks = [statistics.mean(r["numerical_rank"] / r["d_in"] for r in live if r["type"] == t) for t in types]
    ax.hlines(ranks, [i - 0.45 for i in range(len(types))], [i + 0.45 for i in range(len(types))], color="black",
              lw=2, label="numerical rank of C / d_in")  # fmt: skip
    ax.set_xticks(range(len(types)))
    ax.set_xticklabels(types, rotation=25, ha="right", fontsize=9)
    ax.set_ylabel(r"mean kept-rank ratio $K / d_{in}$" + (" (log)" if smallest < 0.05 else ""))
    ax.set_xlabel("layer type")
    if smallest < 0.05:  # low-rank experts: the adaptive cuts are a few % of d_in, invisible on a linear axis
        ax.set_yscale("log")
        ax.set_ylim(smallest / 2, 2.0)
    else:
        ax.set_ylim(0, 1.12)
    ax.set_title("Kept rank by layer type and rank rule (mean over layers of the type)")
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mean_of(rows: Sequence[dict[str, Any]], layer_type: str, key: str) -> float:
    values = [r[key] for r in rows if r["type"] == layer_type]
    return sum(values) / len(values)


def _plot_delta_norms(path: Path, rows: Sequence[dict[str, Any]], specs: Sequence[MethodSpec]) -> None:
    import matplotlib.pyplot as plt

    fig, (ax, bar_ax) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [2.2, 1]})
    x = range(1, len(rows) + 1)
    markers = "osD^vx*+"
    for i, (spec, lw) in enumerate(zip(specs, _layered(len(specs)), strict=True)):
        values = [max(r[f"norm[{spec.label}]"], 1e-30) for r in rows]
        ax.semilogy(x, values, marker=markers[i % len(markers)], ms=3.5, lw=lw, alpha=0.85, label=spec.label)
    norms = [r[f"norm[{spec.label}]"] for r in rows for spec in specs if r[f"norm[{spec.label}]"] > 0]
    _plain_log_ticks(ax.yaxis, math.log10(max(norms) / min(norms)) if norms else 1.0)
    ax.set_xlabel("layer (model order)")
    ax.set_ylabel(r"$\|\hat\tau\|_F$ of the merged delta")
    ax.set_title("Merged-delta norm per layer")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncols=3, frameon=False)
    totals = [math.sqrt(sum(r[f"norm[{spec.label}]"] ** 2 for r in rows)) for spec in specs]
    colors = [f"C{i}" for i in range(len(specs))]
    bar_ax.barh(range(len(specs)), totals, color=colors)
    bar_ax.set_yticks(range(len(specs)))
    bar_ax.set_yticklabels([s.label for s in specs], fontsize=8)
    bar_ax.invert_yaxis()
    spread = max(totals) / max(min(totals), 1e-30)
    if spread > 30:  # a norm shortcut of orders of magnitude: log scale, else linear stays readable
        bar_ax.set_xscale("log")
    bar_ax.set_xlim(right=max(totals) * (4 if spread > 30 else 1.25))
    bar_ax.set_xlabel(r"$\|\hat\tau\|_F$ over all inspected layers" + (" (log)" if spread > 30 else ""))
    bar_ax.set_title("Whole-model merged-delta norm")
    for i, v in enumerate(totals):
        bar_ax.text(v, i, f" {v:.3g}", va="center", fontsize=8)
    bar_ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_filter_shapes(path: Path, filters: dict[str, Any]) -> None:
    import matplotlib.pyplot as plt

    lam = filters["eigenvalues"]
    positive = lam > 0
    k = torch.arange(1, lam.numel() + 1)[positive]
    fig, (ax, gain_ax) = plt.subplots(1, 2, figsize=(12, 4.4))
    styles = ["-", "--", "-.", ":", "-"]
    gains = filters["gains"]
    for (name, h), style, lw in zip(gains.items(), styles, _layered(len(gains)), strict=False):
        ax.plot(k, h[positive], ls=style, lw=lw, alpha=0.85, label=name)
        inverse = (h[positive] / lam[positive]).clamp(min=1e-30)
        gain_ax.semilogy(k, inverse, ls=style, lw=lw, alpha=0.85, label=name)
    ax.set_xlabel("eigen-direction k (descending eigenvalue)")
    ax.set_ylabel(r"filter $h_k$")
    ax.set_ylim(-0.03, 1.05)
    ax.set_title("Filter shapes")
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(True, alpha=0.3)
    gain_ax.set_xlabel("eigen-direction k (descending eigenvalue)")
    gain_ax.set_ylabel(r"inverse gain $h_k / \lambda_k$ (log)")
    inverse_gains = 1 / lam[positive]
    gain_ax.set_ylim(float(inverse_gains.min()) / 10, float(inverse_gains.max()) * 3)
    gain_ax.set_title("Effective inverse gain (0 = direction dropped)")
    gain_ax.grid(True, which="major", alpha=0.3)
    rank = int(positive.sum())
    shown = f" ({rank} non-zero of d_in = {lam.numel()} directions shown)" if rank < lam.numel() else ""
    fig.suptitle(f"Spectral filters on {_short(filters['layer'], 70)}{shown}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_optimizer_filter(
    path: Path, fits: Sequence[FilterFit], filters: dict[str, Any] | None, layer: str | None
) -> None:
    import matplotlib.pyplot as plt

    from specmerge.linalg.filters import Exponential, Landweber

    lam = filters["fit_eigenvalues"].double()
    grid = torch.logspace(math.log10(float(lam.min())), math.log10(float(lam.max())), 200, dtype=torch.float64)
    fig, axes = plt.subplots(1, 3, figsize=(17, 5.6))
    for ax, optimizer, title in ((axes[0], "adam", "Adam"), (axes[1], "sgd", "plain gradient descent")):
        own = [f for f in fits if f.optimizer == optimizer]
        shown = own if len(own) <= 4 else [own[i] for i in _spread(len(own), 4)]
        for i, fit in enumerate(shown):
            if optimizer == "adam":
                curve = Exponential(fit.t_eff)(grid)
                text = f"exponential t={fit.t_eff:.3g}, R²={fit.r2_exponential:.4f}, RMSE={fit.rmse_exponential:.1e}"
            else:
                curve = Landweber(2 * fit.lr, fit.n_eff)(grid)
                text = f"Landweber n={fit.n_eff:.4g}, R²={fit.r2_landweber:.6f}, RMSE={fit.rmse_landweber:.1e}"
            if math.isnan(fit.r2_exponential):
                error = fit.rmse_exponential if optimizer == "adam" else fit.rmse_landweber
                text = f"saturated (h = 1 everywhere, no R²), RMSE={error:.1e}"
            ax.scatter(lam, fit.h, s=9, color=f"C{i}", alpha=0.55)
            ax.plot(grid, curve, color=f"C{i}", lw=1.4, label=f"step {fit.step}: {text}")
        ax.set_xscale("log")
        _plain_log_ticks(ax.xaxis, math.log10(float(lam.max() / lam.min())))
        ax.set_xlabel(r"eigenvalue $\lambda_k$ of C (log)")
        ax.set_ylabel(r"empirical filter $h_k$ (dots) and fit (lines)")
        ax.set_title(f"{title}, lr {own[0].lr:.3g}")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncols=1, frameon=False)
    ax = axes[2]
    for optimizer, marker, name in (("adam", "o", "Adam"), ("sgd", "s", "GD")):
        own = [f for f in fits if f.optimizer == optimizer]
        steps = [f.step for f in own]
        ax.plot(steps, [f.r2_exponential for f in own], marker=marker, ls="-", label=f"{name}: exponential fit")
        ax.plot(steps, [f.r2_landweber for f in own], marker=marker, ms=4, ls="--", label=f"{name}: Landweber fit")
    ax.set_xscale("log")
    ax.set_xlabel("optimizer steps (log)")
    ax.set_ylabel(r"$R^2$ of the best fit")
    values = [v for f in fits for v in (f.r2_exponential, f.r2_landweber) if math.isfinite(v)]
    clipped = min([*values, 0.9]) < -1.0
    ax.set_ylim(max(min([*values, 0.9]), -1.0) - 0.02, 1.01)
    if clipped:
        ax.set_ylabel(r"$R^2$ of the best fit (axis clipped at -1)")
    ax.set_title(r"Fit quality $R^2$ vs steps")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncols=2, frameon=False)
    fig.suptitle(f"Optimizer as a spectral filter (iterative WUDI) on {_short(layer or '', 70)}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _spread(n: int, k: int) -> list[int]:
    """k indices spread evenly over range(n), first and last included."""
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})
