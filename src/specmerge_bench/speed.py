"""Per-layer speed and memory of the merge methods: ``specmerge-bench speed``.

Layers are synthetic with real-looking spectra: tau_i = A_i B_i (rank 32) + i.i.d. noise at 20 % of the
signal's norm, entries ~1e-3. Two shape sets:

- ``clip``: CLIP-ViT-B/32, N = 8 experts, 12 blocks x {attn.in_proj 2304x768, attn.out_proj 768x768,
  mlp.fc1 3072x768, mlp.fc2 768x3072};
- ``llama3b``: one Llama-3.2-3B decoder layer, N = 5 experts: q/o_proj 3072x3072 (x2), k/v_proj 1024x3072
  (x2), gate/up_proj 8192x3072 (x2), down_proj 3072x8192 (x1).

Methods (:func:`entries`): the reference-style WUDI (``REFERENCE``, the baseline of the ratio table) and
every featured method of the registry, one column per accuracy-benchmark setting it declares (e.g. SWUDI-A
psqrt and Gavish-Donoho), at that setting's fixed parameters and the registry defaults otherwise (a grid
is not swept). Every method runs on the same inputs in the same process, one after another: the median
wall time of ``--repeats`` runs after one warm-up. Iterative methods (those with a ``steps`` parameter:
WUDI, OptMerge, 300 steps each) cost the same per step, so by default they are timed at two short step
counts and extrapolated to their step count S: t(S) = t(a) + (S - a) (t(b) - t(a)) / (b - a);
``--full-iterative`` runs the S steps instead. Peak memory (``--memory``) is measured in a fresh process per
(layer, method): the peak resident set (Linux VmHWM, reset after the inputs are built) above the resident
set with the inputs in place, i.e. the method's own working memory (:class:`specmerge_bench.memory.Sampler`);
on CUDA, ``torch.cuda.max_memory_allocated`` above the inputs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specmerge.methods import Method, Setting, all_methods, get_method
from specmerge_bench.memory import Sampler

REFERENCE = "wudi_reference"  # WUDI as published: always timed, the baseline of the ratios


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
    """One timed column: a registry method with fixed parameters; ``steps`` is set for iterative methods."""

    label: str
    method: str
    params: tuple[tuple[str, Any], ...] = ()
    steps: int | None = None  # the step count timed (or extrapolated to), for a method with a ``steps`` parameter

    @property
    def iterative(self) -> bool:
        return self.steps is not None


def _entry(label: str, method: Method, params: Mapping[str, Any]) -> Entry:
    steps = None
    if any(p.name == "steps" for p in method.params):  # iterative: cost per step is constant
        steps = int(params.get("steps", method.param("steps").default))
    return Entry(label, method.name, tuple(sorted(params.items())), steps)


def entries() -> dict[str, Entry]:
    """Label -> column: ``REFERENCE``, then every setting of every featured method, in registry order.

    A featured method without benchmark settings gets one column at its defaults; a setting's grid is not
    swept (its parameters take the registry defaults)."""
    methods = all_methods()
    out = {REFERENCE: _entry(REFERENCE, methods[REFERENCE], {})}
    for method in methods.values():
        if method.featured:
            for setting in method.settings or (Setting(method.name, method.title),):
                out.setdefault(setting.label, _entry(setting.label, method, setting.params))
    return out


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


def best_seconds(fn: Callable[[], Any], repeats: int, device: torch.device | None = None) -> tuple[float, Any]:
    """(the shortest wall time of ``repeats`` calls of ``fn``, the last call's result); on a CUDA ``device`` each
    call is timed from a synchronized start to its kernels' end."""
    times, out = [], None
    for _ in range(repeats):
        if device is not None:
            _sync(device)
        start = time.perf_counter()
        out = fn()
        if device is not None:
            _sync(device)
        times.append(time.perf_counter() - start)
    return min(times), out


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
    return t_a + (entry.steps - a) * per_step, {"extrapolated_from": [a, b], "seconds_at": [t_a, t_b]}


def peak_bytes_here(entry: Entry, stack: torch.Tensor, steps: int | None) -> int:
    """The method's peak working memory in this process, above what it holds with ``stack`` in place."""
    if stack.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        _run(entry, stack, steps)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with Sampler(period=None, reset_peak=True) as sampler:  # VmHWM is the kernel's exact peak: no polling
        _run(entry, stack, steps)
    return sampler.above_baseline("VmHWM", "VmRSS")


def peak_bytes(shape_set: ShapeSet, layer: Layer, entry: Entry, device: str, steps: int | None) -> int:
    """:func:`peak_bytes_here` in a fresh Python process (no allocator state left over from other runs)."""
    job = json.dumps([shape_set.name, layer.name, entry.label, device, steps])
    code = "import sys; from specmerge_bench.speed import measure_child; print(measure_child(sys.argv[1]))"
    out = subprocess.run([sys.executable, "-c", code, job], check=True, capture_output=True, text=True)
    return int(out.stdout.strip().splitlines()[-1])


def measure_child(job: str) -> int:
    """:func:`peak_bytes_here` for a JSON job ``[set, layer, label, device, steps]`` (run by :func:`peak_bytes`)."""
    set_name, layer_name, label, device, steps = json.loads(job)
    shape_set = SHAPE_SETS[set_name]
    layer = next(x for x in shape_set.layers if x.name == layer_name)
    stack = synthetic_stack(shape_set.n_experts, layer.d_out, layer.d_in).to(device)
    return peak_bytes_here(entries()[label], stack, steps)


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
    """Seconds (and peak bytes) per layer and method (``labels`` of :func:`entries`), and the whole set's totals."""
    columns = entries()
    rows = []
    for layer in shape_set.layers:
        stack = synthetic_stack(shape_set.n_experts, layer.d_out, layer.d_in).to(device)
        row: dict[str, Any] = {"layer": layer.name, "d_out": layer.d_out, "d_in": layer.d_in, "count": layer.count,
                               "seconds": {}, "peak_bytes": {}, "notes": {}}  # fmt: skip
        for label in labels:
            entry = columns[label]
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
    """Time the full step count of the iterative ``labels`` on one layer, next to their extrapolated seconds."""
    layer = next((x for x in shape_set.layers if x.name == layer_name), None)
    if layer is None:
        return []
    row = next(r for r in result["rows"] if r["layer"] == layer_name)
    columns = entries()
    stack = synthetic_stack(shape_set.n_experts, layer.d_out, layer.d_in).to(device)
    checks = []
    for label in labels:
        measured = median_seconds(lambda e=columns[label]: _run(e, stack), 1, torch.device(device), warm_up=False)
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


def configure(parser: argparse.ArgumentParser) -> None:
    """The options of ``specmerge-bench speed``; the parsed arguments go to :func:`run`."""
    columns = list(entries())
    parser.add_argument("--sets", nargs="+", choices=sorted(SHAPE_SETS), default=["clip", "llama3b"],
                        help="shape sets to time (default: clip llama3b; tiny: a smoke test)")  # fmt: skip
    parser.add_argument("--methods", nargs="+", choices=columns, default=columns, metavar="LABEL",
                        help=f"columns to time (default: all): {', '.join(columns)}")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per method after a warm-up (median)")
    parser.add_argument("--iterative-repeats", type=int, default=1, help="timed runs of the iterative methods")
    parser.add_argument("--short-steps", type=int, nargs=2, default=[10, 30], metavar=("A", "B"),
                        help="step counts the iterative methods are timed at, then extrapolated (A < B)")  # fmt: skip
    parser.add_argument("--full-iterative", action="store_true", help="run the iterative methods' full step counts")
    parser.add_argument("--memory", action="store_true", help="also peak working memory (one fresh process each)")
    parser.add_argument("--validate-extrapolation", metavar="LAYER",
                        help="also time the iterative methods' full step counts on this layer of each set")  # fmt: skip
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", type=Path, help="also write the raw figures to this file")
    parser.set_defaults(run=lambda args: run(args, parser))


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> torch.device:
    """Refuse bad option values with one line (argparse's usage error), before anything is timed."""
    for name in ("repeats", "iterative_repeats", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    a, b = args.short_steps
    if not 1 <= a < b:
        parser.error(f"--short-steps A B needs 1 <= A < B, got {a} {b}")
    if args.validate_extrapolation:
        for name in args.sets:
            layers = [layer.name for layer in SHAPE_SETS[name].layers]
            if args.validate_extrapolation not in layers:
                parser.error(f"--validate-extrapolation: set {name} has no layer {args.validate_extrapolation!r}; "
                             f"its layers: {', '.join(layers)}")  # fmt: skip
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"--json {args.json}: folder {args.json.parent} does not exist")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device!r} is not a device (cpu, cuda, cuda:N)")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available on this machine (torch {torch.__version__})")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {args.device}: only cpu and cuda are supported")
    return device


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``specmerge-bench speed``: per-layer time (and memory) of every featured method on CLIP-B/32 and Llama-3B
    shapes; prints Markdown tables."""
    device = _check(parser, args)
    columns = entries()
    if args.threads:
        torch.set_num_threads(args.threads)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    print(f"# torch {torch.__version__}, {device} ({name}), {torch.get_num_threads()} threads, float32")
    short = None if args.full_iterative else tuple(args.short_steps)
    print(f"# iterative methods: {'full step counts' if short is None else f'timed at {short} steps, extrapolated'}")
    results = []
    for set_name in args.sets:
        result = measure(
            SHAPE_SETS[set_name], args.methods, repeats=args.repeats, iterative_repeats=args.iterative_repeats,
            short_steps=short, memory=args.memory, device=args.device, log=lambda line: print(line, file=sys.stderr),
        )  # fmt: skip
        if args.validate_extrapolation and short is not None:
            iterative = [m for m in args.methods if columns[m].iterative]
            layer = args.validate_extrapolation
            result["validation"] = validate_extrapolation(SHAPE_SETS[set_name], result, layer, iterative, args.device)
        results.append(result)
        print("\n" + markdown(result, args.methods) + "\n", flush=True)
        for check in result.get("validation", []):
            head = f"- extrapolation check, {check['layer']} {check['method']}"
            measured = f"measured ({columns[check['method']].steps} steps) {check['measured']:.3g} s"
            print(f"{head}: extrapolated {check['extrapolated']:.3g} s, {measured}")
    if args.json:
        args.json.write_text(json.dumps({"device": name, "threads": torch.get_num_threads(), "results": results}))
    return 0
