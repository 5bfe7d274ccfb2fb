"""Per-layer speed and memory of the merge methods: ``specmerge bench speed``.

Layers are synthetic with real-looking spectra: tau_i = A_i B_i (rank 32) + i.i.d. noise at 20 % of the
signal's norm, entries ~1e-3. Two shape sets:

- ``clip``: CLIP-ViT-B/32, N = 8 experts, 12 blocks x {attn.in_proj 2304x768, attn.out_proj 768x768,
  mlp.fc1 3072x768, mlp.fc2 768x3072};
- ``llama3b``: one Llama-3.2-3B decoder layer, N = 5 experts: q/o_proj 3072x3072 (x2), k/v_proj 1024x3072
  (x2), gate/up_proj 8192x3072 (x2), down_proj 3072x8192 (x1).

Every method runs at its registry defaults on the same inputs in the same process, one after another: the
median wall time of ``--repeats`` runs after one warm-up. The iterative methods (WUDI and the reference-style
WUDI, 300 Adam steps each) cost the same per step, so by default they are timed at two short step counts and
extrapolated to 300 steps: t(300) = t(a) + (300 - a) (t(b) - t(a)) / (b - a); ``--full-iterative`` runs the
300 steps instead. Peak memory (``--memory``) is measured in a fresh process per (layer, method): the peak
resident set (Linux VmHWM, reset after the inputs are built) above the resident set with the inputs in place,
i.e. the method's own working memory; on CUDA, ``torch.cuda.max_memory_allocated`` above the inputs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specmerge.methods.registry import get_method

STEPS = 300  # WUDI's published step count


@dataclass(frozen=True)
class Layer:
    name: str
    d_out: int
    d_in: int
    count: int  # how many layers of this shape the set has


@dataclass(frozen=True)
class ShapeSet:
    name: str
    title: str
    n_experts: int
    layers: tuple[Layer, ...]


# fmt: off
SHAPE_SETS = {
    "clip": ShapeSet("clip", "CLIP-ViT-B/32 (12 blocks), N = 8", 8, (
        Layer("attn.in_proj", 2304, 768, 12), Layer("attn.out_proj", 768, 768, 12),
        Layer("mlp.fc1", 3072, 768, 12), Layer("mlp.fc2", 768, 3072, 12),
    )),
    "llama3b": ShapeSet("llama3b", "Llama-3.2-3B decoder layer, N = 5", 5, (
        Layer("q_proj / o_proj", 3072, 3072, 2), Layer("k_proj / v_proj", 1024, 3072, 2),
        Layer("gate_proj / up_proj", 8192, 3072, 2), Layer("down_proj", 3072, 8192, 1),
    )),
    "tiny": ShapeSet("tiny", "tiny smoke-test shapes, N = 3", 3, (Layer("wide", 16, 48, 2), Layer("tall", 48, 16, 1))),
}
# fmt: on


@dataclass(frozen=True)
class Entry:
    label: str
    method: str
    params: tuple[tuple[str, Any], ...] = ()

    @property
    def iterative(self) -> bool:
        return self.method in ("wudi", "wudi_reference")


METHODS = {
    e.label: e
    for e in (
        Entry("wudi_reference", "wudi_reference"),
        Entry("wudi", "wudi"),
        Entry("swudi", "swudi"),
        Entry("swudi_a_psqrt", "swudi_a", (("rule", "psqrt"),)),
        Entry("swudi_a_gd", "swudi_a", (("rule", "gavish_donoho"),)),
        Entry("tsv_m", "tsv_m"),
        Entry("iso_c", "iso_c"),
        Entry("task_arithmetic", "task_arithmetic"),
    )
}


def synthetic_stack(
    n: int, d_out: int, d_in: int, rank: int = 32, noise: float = 0.2, seed: int = 0, dtype=torch.float32
) -> torch.Tensor:
    """N x d_out x d_in task vectors: rank-``rank`` signal + i.i.d. noise at ``noise`` x its norm, std 1e-3."""
    g = torch.Generator().manual_seed(seed)
    tau = torch.empty(n, d_out, d_in)
    for i in range(n):  # one expert at a time: no second full-size temporary
        signal = torch.randn(d_out, rank, generator=g) @ torch.randn(rank, d_in, generator=g)
        fuzz = torch.randn(d_out, d_in, generator=g)
        fuzz *= noise * signal.norm() / fuzz.norm()
        tau[i] = signal.add_(fuzz)
    tau *= 1e-3 / tau.std()
    return tau.to(dtype)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown cpu"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run(entry: Entry, stack: torch.Tensor, steps: int | None = None) -> dict:
    params = dict(entry.params)
    if steps is not None:
        params["steps"] = steps
    return get_method(entry.method)(stack, **params).diagnostics


def median_seconds(fn: Callable[[], Any], repeats: int, device: torch.device, warm_up: bool = True) -> float:
    """Median wall time of ``repeats`` calls of ``fn`` (after one untimed warm-up call)."""
    if warm_up:
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_entry(
    entry: Entry, stack: torch.Tensor, repeats: int, short_steps: tuple[int, int] | None
) -> tuple[float, dict[str, Any]]:
    """(seconds for the method as registered, notes): iterative ones extrapolated from ``short_steps``."""
    device = stack.device
    if not entry.iterative or short_steps is None:
        diagnostics = _run(entry, stack)  # also the warm-up
        seconds = median_seconds(lambda: _run(entry, stack), repeats, device, warm_up=False)
        return seconds, {"kept_rank": diagnostics.get("kept_rank")}
    a, b = short_steps
    _run(entry, stack, a)  # warm-up
    t_a = median_seconds(lambda: _run(entry, stack, a), repeats, device, warm_up=False)
    t_b = median_seconds(lambda: _run(entry, stack, b), repeats, device, warm_up=False)
    per_step = max(t_b - t_a, 0.0) / (b - a)
    return t_a + (STEPS - a) * per_step, {"extrapolated_from": [a, b], "seconds_at": [t_a, t_b]}


def _vm(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def peak_bytes_here(entry: Entry, stack: torch.Tensor, steps: int | None) -> int:
    """The method's peak working memory in this process, above what it holds with ``stack`` in place."""
    if stack.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        _run(entry, stack, steps)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current resident set
        f.write("5")
    before = _vm("VmRSS")
    _run(entry, stack, steps)
    return _vm("VmHWM") - before


def peak_bytes(shape_set: ShapeSet, layer: Layer, entry: Entry, device: str, steps: int | None) -> int:
    """:func:`peak_bytes_here` in a fresh Python process (no allocator state left over from other runs)."""
    job = json.dumps([shape_set.name, layer.name, entry.label, device, steps])
    code = "import sys, json; from specmerge_bench.speed import _measure_child; print(_measure_child(sys.argv[1]))"
    out = subprocess.run([sys.executable, "-c", code, job], check=True, capture_output=True, text=True)
    return int(out.stdout.strip().splitlines()[-1])


def _measure_child(job: str) -> int:
    set_name, layer_name, label, device, steps = json.loads(job)
    shape_set = SHAPE_SETS[set_name]
    layer = next(x for x in shape_set.layers if x.name == layer_name)
    stack = synthetic_stack(shape_set.n_experts, layer.d_out, layer.d_in).to(device)
    return peak_bytes_here(METHODS[label], stack, steps)


def measure(
    shape_set: ShapeSet,
    labels: Sequence[str],
    *,
    repeats: int = 3,
    iterative_repeats: int = 1,
    short_steps: tuple[int, int] | None = (10, 30),
    memory: bool = False,
    device: str = "cpu",
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Seconds (and peak bytes) per layer and method, and the whole set's totals."""
    rows = []
    for layer in shape_set.layers:
        stack = synthetic_stack(shape_set.n_experts, layer.d_out, layer.d_in).to(device)
        row: dict[str, Any] = {"layer": layer.name, "d_out": layer.d_out, "d_in": layer.d_in, "count": layer.count,
                               "seconds": {}, "peak_bytes": {}, "notes": {}}  # fmt: skip
        for label in labels:
            entry = METHODS[label]
            reps = iterative_repeats if entry.iterative else repeats
            seconds, notes = time_entry(entry, stack, reps, short_steps)
            row["seconds"][label], row["notes"][label] = seconds, notes
            if memory:
                # the peak of an iterative method does not depend on its step count: measure a short run
                steps = short_steps[0] if entry.iterative and short_steps else None
                row["peak_bytes"][label] = peak_bytes(shape_set, layer, entry, device, steps)
            log(f"  {shape_set.name} {layer.name} {label}: {seconds:.4g} s")
        rows.append(row)
        del stack
    totals = {label: sum(r["seconds"][label] * r["count"] for r in rows) for label in labels}
    peaks = {label: max(r["peak_bytes"][label] for r in rows) for label in labels} if memory else {}
    return {"set": shape_set.name, "title": shape_set.title, "rows": rows, "total_seconds": totals, "peak_bytes": peaks}


def validate_extrapolation(
    shape_set: ShapeSet, result: dict[str, Any], layer_name: str, labels: Sequence[str], device: str
) -> list[dict[str, Any]]:
    """Time the full 300 steps of the iterative ``labels`` on one layer, next to their extrapolated seconds."""
    layer = next((x for x in shape_set.layers if x.name == layer_name), None)
    if layer is None:
        return []
    row = next(r for r in result["rows"] if r["layer"] == layer_name)
    stack = synthetic_stack(shape_set.n_experts, layer.d_out, layer.d_in).to(device)
    checks = []
    for label in labels:
        measured = median_seconds(lambda e=METHODS[label]: _run(e, stack), 1, torch.device(device), warm_up=False)
        checks.append(
            {"layer": layer_name, "method": label, "extrapolated": row["seconds"][label], "measured": measured}
        )
    return checks


def markdown(result: dict[str, Any], labels: Sequence[str], reference: str = "wudi_reference") -> str:
    """Per-layer seconds (and peak MiB), set totals, and ratios against ``reference`` (if measured)."""
    mib = 2.0**20
    lines = [f"### {result['title']}", "", "Seconds per layer (median):", ""]
    lines += ["| layer (d_out x d_in) | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    for r in result["rows"]:
        cells = " | ".join(f"{r['seconds'][m]:.3g}" for m in labels)
        lines.append(f"| {r['layer']} ({r['d_out']}x{r['d_in']}) x{r['count']} | {cells} |")
    total = result["total_seconds"]
    lines.append("| **whole set** | " + " | ".join(f"**{total[m]:.3g}**" for m in labels) + " |")
    if result["peak_bytes"]:
        lines += ["", "Peak working memory per layer (MiB above the inputs):", ""]
        lines += ["| layer | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
        for r in result["rows"]:
            lines.append(f"| {r['layer']} | " + " | ".join(f"{r['peak_bytes'][m] / mib:.0f}" for m in labels) + " |")
        peak = result["peak_bytes"]
        lines.append("| **max over the set** | " + " | ".join(f"**{peak[m] / mib:.0f}**" for m in labels) + " |")
    if reference in labels:
        lines += ["", f"Against {reference} (time ratio = its seconds / the method's; memory ratio = the method's"
                  f" peak / its peak):", ""]  # fmt: skip
        lines += ["| | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
        lines.append(
            "| speed-up, whole set | " + " | ".join(f"{total[reference] / total[m]:.1f}x" for m in labels) + " |"
        )
        if result["peak_bytes"]:
            peak = result["peak_bytes"]
            lines.append(
                "| memory ratio, max | " + " | ".join(f"{peak[m] / peak[reference]:.2f}" for m in labels) + " |"
            )
    kept = {r["layer"]: {m: r["notes"][m].get("kept_rank") for m in labels if r["notes"][m].get("kept_rank")}
            for r in result["rows"]}  # fmt: skip
    lines += ["", "Kept rank K per layer: " + "; ".join(
        f"{layer}: " + ", ".join(f"{m} {k}" for m, k in ks.items()) for layer, ks in kept.items() if ks)]  # fmt: skip
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``specmerge bench speed``: per-layer time (and memory) of every method on CLIP-B/32 and Llama-3B shapes."""
    parser = argparse.ArgumentParser(prog="specmerge bench speed", description=main.__doc__.split(":", 1)[1].strip())
    parser.add_argument("--sets", nargs="+", choices=sorted(SHAPE_SETS), default=["clip", "llama3b"])
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method after a warm-up (median)")
    parser.add_argument("--iterative-repeats", type=int, default=1, help="timed runs of the iterative methods")
    parser.add_argument("--short-steps", type=int, nargs=2, default=[10, 30], metavar=("A", "B"),
                        help="step counts the iterative methods are timed at, extrapolated to 300")  # fmt: skip
    parser.add_argument("--full-iterative", action="store_true", help="run the iterative methods' 300 steps")
    parser.add_argument("--memory", action="store_true", help="also peak working memory (one fresh process each)")
    parser.add_argument("--validate-extrapolation", metavar="LAYER",
                        help="also time the iterative methods' full 300 steps on this layer of each set")  # fmt: skip
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    print(f"# torch {torch.__version__}, {device} ({name}), {torch.get_num_threads()} threads, float32")
    short = None if args.full_iterative else tuple(args.short_steps)
    print(f"# iterative methods: {'300 steps' if short is None else f'timed at {short} steps, extrapolated to 300'}")
    results = []
    for set_name in args.sets:
        result = measure(
            SHAPE_SETS[set_name], args.methods, repeats=args.repeats, iterative_repeats=args.iterative_repeats,
            short_steps=short, memory=args.memory, device=args.device, log=lambda line: print(line, file=sys.stderr),
        )  # fmt: skip
        if args.validate_extrapolation and short is not None:
            iterative = [m for m in args.methods if METHODS[m].iterative]
            layer = args.validate_extrapolation
            result["validation"] = validate_extrapolation(SHAPE_SETS[set_name], result, layer, iterative, args.device)
        results.append(result)
        print("\n" + markdown(result, args.methods) + "\n", flush=True)
        for check in result.get("validation", []):
            head = f"- extrapolation check, {check['layer']} {check['method']}"
            print(f"{head}: extrapolated {check['extrapolated']:.3g} s, measured (300 steps) {check['measured']:.3g} s")
    if args.json:
        args.json.write_text(json.dumps({"device": name, "threads": torch.get_num_threads(), "results": results}))
    return 0
