"""The dry run (``specmerge merge ... --dry-run``): the whole plan with its bytes, peak memory and time, and nothing
read but the files' headers (and two timed 16 MiB reads), nothing written.

:func:`dry_run` prepares the merge as a real one does (:func:`~specmerge.pipeline.plan.prepare.prepare_merge`: inputs
opened and checked, the plan made; the output folder, if given, is checked but not created), builds the job the
merge would run, and prices every work item with the cost model (:mod:`specmerge.pipeline.estimate.cost`). It returns
the estimate as a dict (JSON-ready): the tensors grouped by action, method, route and shape (with their reasons), the
totals per route, the bytes read per input and written, the peak memory and where it is reached, the rates and
how they were obtained, and what the model assumed; ``tensors=True`` adds one row per tensor.
:func:`format_estimate` prints it as a table.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from specmerge.io.output.folder import check_output
from specmerge.pipeline.estimate.calibrate import ComputeRates, InputReads, process_age, process_rss
from specmerge.pipeline.estimate.cost import BASE, ItemCost, estimate_items, expert_labels, peak_memory, spare_cpu
from specmerge.pipeline.inputs.open import refuse_output_inside_inputs
from specmerge.pipeline.plan.prepare import prepare_merge
from specmerge.pipeline.recipe.model import Recipe
from specmerge.pipeline.run.compute import ROUTES
from specmerge.pipeline.run.jobs import AdapterJob, ComputeOptions, ModelJob
from specmerge.pipeline.run.threads import check_threads, merge_threads


def dry_run(
    recipe: Recipe,
    output: str | os.PathLike | None = None,
    *,
    overwrite: bool = False,
    fsync: bool = True,
    threads: int | None = None,
    tensors: bool = False,
    probe: bool = True,
) -> dict[str, Any]:
    """The plan of ``recipe`` and its estimated cost, without merging (see the module docstring).

    ``output`` is checked as a merge checks it (nothing is created); ``fsync``, ``threads`` as for the merge
    estimated. ``probe`` False: no timed read of the inputs (their rates are then assumed).
    """
    started, startup = time.perf_counter(), process_age()
    baseline = process_rss()  # the process before any input is opened: torch and specmerge imported
    check_threads(threads)
    if output is not None:
        refuse_output_inside_inputs(Path(output), [recipe.base, *recipe.experts])
        check_output(output, overwrite)
    options, absent = compute_options(recipe)
    with ExitStack() as stack:
        chosen = stack.enter_context(merge_threads(threads))
        prepared = prepare_merge(stack, recipe, output)
        prepare_s = time.perf_counter() - started
        if recipe.output_format == "lora":
            job: ModelJob | AdapterJob = AdapterJob(prepared.plan, prepared.experts, options, max_rank=recipe.max_rank)
            base = None
        else:
            job = ModelJob(prepared.plan, prepared.base, prepared.experts, _nothing, options, fsync=fsync)
            base = prepared.base
        costs, rates, reads = estimate_items(
            job.items,
            base,
            prepared.experts,
            device=options.device,
            compute_dtype=options.compute_dtype,
            expert_keys=recipe.expert_keys,
            fsync=fsync,
            write_output=recipe.output_format == "model",
            probe=probe,
        )
        peak, where = peak_memory(costs, baseline)
        inputs = list(zip(expert_labels(len(prepared.experts), recipe.expert_keys), prepared.expert_paths, strict=True))
        if base is not None:
            inputs.insert(0, (BASE, prepared.base_path))
        estimate = {
            "method": recipe.method,
            "params": recipe.params,
            "expert_weights": recipe.expert_weights,
            "output": None if output is None else os.fspath(output),  # as given
            "output_format": recipe.output_format,
            "device": str(options.device),
            "compute_dtype": recipe.compute_dtype,
            "threads": chosen.threads,
            "threads_from": chosen.source,
            "io_overlaps_compute": spare_cpu(chosen.threads),
            "groups": groups(costs),
            "routes": by_route(costs),
            "inputs": {
                label: {
                    "path": str(path),
                    "read_bytes": sum(c.reads.get(label, 0) for c in costs),
                    "in_page_cache": round(reads.resident.get(label, 0.0), 4),
                }
                for label, path in inputs
            },
            "total": {**_totals(costs, prepare_s), "startup_s": startup},
            "peak_memory": {
                "bytes": peak,
                "process_baseline": baseline,
                "at": costs[where].item.name if costs else None,
            },
            "rates": _rates(rates, reads),
            "assumed": sorted({text for c in costs for text in c.operations.assumed}),
            "not_modelled": NOT_MODELLED,
            "summary": prepared.summary,
            "notes": prepared.notes,
        }
        if tensors:
            estimate["tensors"] = tensor_rows(costs)
        if isinstance(job, ModelJob) and (options.device.type == "cuda" or absent):
            from specmerge.pipeline.run.device_plan import plan_for

            estimate["device_plan"] = plan_for(job, recipe, None if absent else options.device)[0].describe()
            if absent:
                estimate["device"] = (
                    f"{recipe.device} (not here: the device plan below is for it, the rest for this CPU)"
                )
    return estimate


def compute_options(recipe: Recipe) -> tuple[ComputeOptions, bool]:
    """The recipe's compute options, and whether its CUDA device is absent: a dry run may plan for a GPU that is not
    here when ``gpu_memory`` says its budget (the per-tensor estimate is then for this machine's CPU)."""
    try:
        return ComputeOptions.for_recipe(recipe), False
    except ValueError as err:
        if not recipe.device.startswith("cuda"):
            raise
        if recipe.gpu_memory is None:
            raise ValueError(
                f"{err}; to plan for a GPU that is not here, give its memory: --gpu-memory 80GiB"
            ) from None
        return ComputeOptions.for_recipe(recipe.model_copy(update={"device": "cpu"})), True


RATE_UNITS = {  # the compute rates of ComputeRates and their units
    "matmul": "flop/s",
    "qr": "flop/s",
    "svd": "s per l k^2",
    "memory": "bytes/s",
    "fresh": "bytes/s",
    "linear": "bytes/s",
    "select": "entries/s",
    "random": "draws/s",
}
NOT_MODELLED = [
    "other processes taking CPUs, memory bandwidth or the disk while the merge runs",
    "the disk's write rate (500 MB/s assumed: timing it would mean writing)",
    "ranks chosen from the data (see assumed), allocator overheads",
    "torch's threads spinning when they and the reader and writer threads want more CPUs than there are",
]


def _nothing(*args: Any, **kwargs: Any) -> None:
    """The write function of a job that is estimated, never run."""
    raise RuntimeError("a dry run writes nothing")


def _key(cost: ItemCost) -> tuple[str, str, str, tuple[int, ...]]:
    entry = cost.item.entry
    return entry.action, entry.method or "", cost.route, entry.shape


def groups(costs: Sequence[ItemCost]) -> list[dict[str, Any]]:
    """The items grouped by (action, method, route, tensor shape), in plan order of first appearance: tensors, work
    items, bytes read and written, estimated seconds and the plan's reasons (with how many tensors give each)."""
    found: dict[tuple, dict[str, Any]] = {}
    for cost in costs:
        entry = cost.item.entry
        group = found.setdefault(
            _key(cost),
            {"action": entry.action, "method": entry.method, "route": cost.route, "shape": list(entry.shape),
             "tensors": 0, "items": 0, "read_bytes": 0, "write_bytes": 0, "seconds": 0.0, "reasons": {}},
        )  # fmt: skip
        group["items"] += 1
        if cost.item.completes:
            group["tensors"] += 1
            group["reasons"][entry.reason] = group["reasons"].get(entry.reason, 0) + 1
        group["read_bytes"] += cost.read_bytes
        group["write_bytes"] += cost.write
        group["seconds"] += cost.seconds
    return list(found.values())


def by_route(costs: Sequence[ItemCost]) -> dict[str, dict[str, Any]]:
    """Per route: what it does, tensors, items, bytes and the seconds of its parts and in all."""
    routes: dict[str, dict[str, Any]] = {}
    for cost in costs:
        row = routes.setdefault(
            cost.route,
            {"does": ROUTES[cost.route], "tensors": 0, "items": 0, "read_bytes": 0, "write_bytes": 0,
             "compute_s": 0.0, "read_s": 0.0, "write_s": 0.0, "seconds": 0.0},
        )  # fmt: skip
        row["tensors"] += int(cost.item.completes)
        row["items"] += 1
        row["read_bytes"] += cost.read_bytes
        row["write_bytes"] += cost.write
        row["compute_s"] += cost.compute_s
        row["read_s"] += cost.read_cached_s + cost.read_disk_s
        row["write_s"] += cost.write_copy_s + cost.write_disk_s
        row["seconds"] += cost.seconds
    return routes


def _totals(costs: Sequence[ItemCost], prepare_s: float) -> dict[str, Any]:
    return {
        "tensors": sum(int(c.item.completes) for c in costs),
        "items": len(costs),
        "read_bytes": sum(c.read_bytes for c in costs),
        "write_bytes": sum(c.write for c in costs),
        "compute_s": sum(c.compute_s for c in costs),
        "read_s": sum(c.read_cached_s + c.read_disk_s for c in costs),
        "write_s": sum(c.write_copy_s + c.write_disk_s for c in costs),
        "seconds": prepare_s + sum(c.seconds for c in costs),
        "prepare_s": prepare_s,
    }


def _rates(rates: ComputeRates, reads: InputReads) -> dict[str, Any]:
    """The rates the estimate used (only those probed: reading the others would probe them) and how."""
    return {
        "threads": rates.threads,
        "compute": {key: getattr(rates, key) for key in RATE_UNITS if key in rates.sources},
        "eigh_seconds": {str(d): s for d, s in rates.eigh_probes.items()},
        "read": {"page_cache_bytes_per_s": reads.cached_rate, "disk_bytes_per_s": reads.disk_rate},
        "write_disk_bytes_per_s": reads.write_rate,
        "how": {**rates.sources, **{f"read {k}": v for k, v in reads.sources.items()}},
        "probe_seconds": rates.probe_seconds + reads.probe_seconds,
    }


def tensor_rows(costs: Sequence[ItemCost]) -> list[dict[str, Any]]:
    """One row per tensor (its row blocks added up): name, action, method, route, reason, bytes and seconds."""
    rows: dict[str, dict[str, Any]] = {}
    for cost in costs:
        entry = cost.item.entry
        row = rows.setdefault(
            entry.name,
            {"name": entry.name, "shape": list(entry.shape), "action": entry.action, "method": entry.method,
             "route": cost.route, "reason": entry.reason, "read_bytes": 0, "write_bytes": 0, "seconds": 0.0},
        )  # fmt: skip
        row["read_bytes"] += cost.read_bytes
        row["write_bytes"] += cost.write
        row["seconds"] += cost.seconds
    return list(rows.values())


# ---------------------------------------------------------------------------------------------
# The printed plan


def human_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB, three significant digits."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def human_seconds(s: float) -> str:
    """Seconds as ``0.4 ms``, ``2.31 s`` or ``6 min 50 s``."""
    if s < 1e-3:
        return "<1 ms"
    if s < 1:
        return f"{s * 1e3:.0f} ms"
    if s < 100:
        return f"{s:.3g} s"
    return f"{int(s // 60)} min {s % 60:.0f} s"


def _reasons(reasons: dict[str, int]) -> str:
    if len(reasons) == 1:
        return next(iter(reasons))
    return "; ".join(f"{reason} ({count})" for reason, count in reasons.items())


def _settings(estimate: dict[str, Any]) -> list[str]:
    """Lines for the expert weights and the values that vary across layers, when there are any."""
    lines = []
    if estimate.get("expert_weights"):
        shown = ", ".join(f"{w:g}" if isinstance(w, float) else str(w) for w in estimate["expert_weights"])
        lines.append(f"expert weights: {shown} (in expert order)")
    for key, value in estimate["params"].items():
        if isinstance(value, list):
            lines.append(
                f"{key} across layers: {' -> '.join(f'{v:g}' for v in value)} (outside the layers {value[0]:g})"
            )
    return lines


def format_estimate(estimate: dict[str, Any]) -> str:
    """The dry run's estimate as text: the grouped plan, the routes, bytes, peak memory, time and assumptions."""
    total, peak = estimate["total"], estimate["peak_memory"]
    where = f" -> {estimate['output']}" if estimate["output"] else ""
    lines = [
        f"dry run: {estimate['method']} merge{where} ({estimate['output_format']}); nothing written",
        f"compute: {estimate['compute_dtype']} on {estimate['device']}, {estimate['threads']} thread"
        f"{'' if estimate['threads'] == 1 else 's'} "
        f"({estimate['threads_from']})",
        *_settings(estimate),
        "",
    ]
    header = ("tensors", "shape", "action", "method", "route", "read", "write", "time", "reasons")
    rows = [
        (str(g["tensors"]), " x ".join(map(str, g["shape"])) or "scalar", g["action"], g["method"] or "-",
         g["route"], human_bytes(g["read_bytes"]), human_bytes(g["write_bytes"]), human_seconds(g["seconds"]),
         _reasons(g["reasons"]))
        for g in estimate["groups"]
    ]  # fmt: skip
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    right = {0, 5, 6, 7}
    for row in [header, *rows]:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=False))]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    lines += ["", "by route:"]
    for name, r in estimate["routes"].items():
        lines.append(
            f"  {name:<9} {r['tensors']:>5} tensors  {human_seconds(r['seconds']):>10}  "
            f"(compute {human_seconds(r['compute_s'])}, read {human_seconds(r['read_s'])}, "
            f"write {human_seconds(r['write_s'])})  {r['does']}"
        )
    lines.append("")
    reads = ", ".join(
        f"{label} {human_bytes(i['read_bytes'])} ({i['in_page_cache']:.0%} in the page cache)"
        for label, i in estimate["inputs"].items()
    )
    lines.append(f"read:   {human_bytes(total['read_bytes'])}: {reads}")
    lines.append(f"write:  {human_bytes(total['write_bytes'])}")
    lines.append(
        f"memory: peak {human_bytes(peak['bytes'])} resident (this process before the merge "
        f"{human_bytes(peak['process_baseline'])} + the largest working set, at {peak['at']})"
    )
    lines.append(
        f"time:   {human_seconds(total['seconds'])} for {total['tensors']} tensors in {total['items']} work items "
        f"(compute {human_seconds(total['compute_s'])}, reading {human_seconds(total['read_s'])}, writing "
        f"{human_seconds(total['write_s'])}; overlapped as the executor overlaps them)"
    )
    if total.get("startup_s") is not None:
        lines.append(
            f"        + {human_seconds(total['startup_s'])} to start a command (Python, torch: this one took that)"
        )
    rates = estimate["rates"]
    probed = [rates["how"][key] for key in rates["compute"]]
    if rates["eigh_seconds"]:
        probed.append(rates["how"]["eigh"])
    probed += [rates["how"][f"read {kind}"] for kind in ("cached", "disk") if "timed" in rates["how"][f"read {kind}"]]
    probed = ", ".join(probed) or "none"
    lines.append(f"rates:  probed in {human_seconds(rates['probe_seconds'])}: {probed}")
    if "device_plan" in estimate:
        lines += device_plan_lines(estimate["device_plan"])
    for text in estimate["assumed"]:
        lines.append(f"assumed: {text}")
    lines.append("not modelled: " + "; ".join(estimate["not_modelled"]))
    return "\n".join(lines)


def device_plan_lines(plan: dict[str, Any]) -> list[str]:
    """The device plan as text: budget, each group's batch and peak, the layers on the CPU, time and its rates."""
    lines = [
        f"device: {plan['device']}, budget {human_bytes(plan['budget_bytes'])} ({plan['budget_from']}), peak "
        f"{human_bytes(plan['peak_bytes'])}, spectral layers {human_seconds(plan['seconds'])} "
        f"(rates: {plan['rates']}, {plan['rates_from']})"
    ]
    for g in plan["groups"]:
        where = (
            f"batches of {g['batch']}, {human_seconds(g['seconds'])}" if g["batch"] else "on the CPU (over the budget)"
        )
        lines.append(
            f"  {g['layers']:>5} x {g['shape'][0]} x {g['shape'][1]} ({g['experts']} experts): peak "
            f"{human_bytes(g['peak_bytes'])} per batch, {where}"
        )
    return lines
