"""Before/after of each optimisation of issue 6, in one run: switch one off at a time and time the merge.

    python bench/ablation.py --models /work/benchdata/llama1b --repeats 5

Task arithmetic of the 1.1B Llama (``MODELS/base`` + ``expert0..3``, fp16 output, in this process, so the
interpreter's start-up is not counted): all optimisations on, then with one of them off:

- ``plain reads``: pread into fresh buffers instead of zero-copy memory maps of each tensor's bytes;
- ``fsync at the end only``: no background fdatasync while a shard is written;
- ``no fsync``: ``fsync=False`` (``--no-fsync``), for reference;
- ``no finite check``: the NaN/Inf check of the inputs (issue 13, item 7) switched off: the chunked linear
  merge as it was before it (:func:`linear_merge_unchecked`) and no min/max pass elsewhere.

Variants are interleaved within each round; medians over ``--repeats`` rounds after one warm-up round.
``--variants`` picks some of them (e.g. ``--variants "all on" "no finite check"``). ``--finite-check-only``
times just the compute of the linear merge (``executor._linear_merge``) with and without the check: each
tensor read once, both variants run ``--repeats`` times on it, alternating, the fastest run of each kept
(steadier than whole merges on a busy machine), summed over the model:

    python bench/ablation.py --models /work/benchdata/llama1b --repeats 7 --finite-check-only

Then (whole-merge mode) TIES on one 5632 x 2048 tensor of four experts (fp16-valued task vectors: many
equal magnitudes): the previous implementation (``torch.topk`` per expert, an N x tensor disjoint mean)
against the radix-select trim and the chunked election and mean, with the outputs compared.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from specmerge.io import sources, writer
from specmerge.methods import baselines
from specmerge.pipeline import api, executor


def _no_maps(*args: object) -> torch.Tensor:
    raise OSError("memory maps switched off")


@contextlib.contextmanager
def _switched(module: object, name: str, value: object) -> Iterator[None]:
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def linear_merge_unchecked(entry, base_tensor, items, coefficient, dtype):
    """``executor._linear_merge`` without the NaN/Inf test of each chunk's sum of squares (before issue 13)."""
    out = torch.empty(base_tensor.shape, dtype=entry.out_dtype)
    flat_out, flat_base = out.view(-1), base_tensor.reshape(-1)
    flat_items = [item.reshape(-1) for item in items]
    chunk = min(executor.CHUNK_ELEMENTS, flat_out.numel())
    base_c, acc, tau = (torch.empty(chunk, dtype=dtype) for _ in range(3))
    squares = 0.0
    for start in range(0, flat_out.numel(), chunk):
        stop = min(start + chunk, flat_out.numel())
        b, a, t = base_c[: stop - start], acc[: stop - start], tau[: stop - start]
        b.copy_(flat_base[start:stop])
        a.copy_(flat_items[0][start:stop]).sub_(b)
        for item in flat_items[1:]:
            a.add_(t.copy_(item[start:stop]).sub_(b))
        a.mul_(coefficient)
        squares += float(torch.dot(a, a))
        flat_out[start:stop].copy_(a.add_(b))
    if entry.action == "average":
        return out, {"route": "dense"}
    return out, {"n_experts": len(items), "delta_norm": math.sqrt(squares), "route": "dense"}


@contextlib.contextmanager
def _no_finite_check() -> Iterator[None]:
    with _switched(executor, "_linear_merge", linear_merge_unchecked), _switched(executor, "_all_finite", _true):
        yield


def _true(*args: object) -> bool:
    return True


VARIANTS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "all on": contextlib.nullcontext,
    "plain reads": lambda: _switched(sources, "_mapped", _no_maps),
    "fsync at the end only": lambda: _switched(writer, "SYNC_BYTES", 2**62),
    "no fsync": contextlib.nullcontext,
    "no finite check": _no_finite_check,
}


def time_merge(models: Path, out: Path, variant: str) -> float:
    shutil.rmtree(out, ignore_errors=True)
    with VARIANTS[variant]():
        start = time.perf_counter()
        api.merge(
            models / "base",
            [models / f"expert{i}" for i in range(4)],
            out,
            method="task_arithmetic",
            params={"scale": 0.3},
            dtype="float16",
            progress=False,
            fsync=variant != "no fsync",
        )
        return time.perf_counter() - start


def ties_before(tau: torch.Tensor, density: float = 0.2) -> torch.Tensor:
    """The previous TIES: torch.topk per expert, then sign election and an N x tensor disjoint mean."""
    k = baselines.top_k_count(density, tau.shape[1])
    trimmed = torch.zeros_like(tau)
    for i, tau_i in enumerate(tau):
        keep = tau_i.abs().topk(k, sorted=False).indices
        trimmed[i, keep] = tau_i[keep]
    sign = torch.sign(trimmed.sum(dim=0))
    agree = (torch.sign(trimmed) == sign) & (sign != 0)
    return torch.where(agree, trimmed, 0.0).sum(dim=0) / agree.sum(dim=0).clamp(min=1)


def time_finite_check(models: Path, repeats: int) -> None:
    """The linear merge's compute over every tensor of the model, with and without the NaN/Inf check.

    Each tensor's inputs are read once; then both variants run ``repeats`` times on them, alternating, and
    each keeps its fastest time (the least disturbed by other processes). Printed: the sums of those minima
    over the model, their ratio, and the median of the per-tensor ratios.
    """
    from specmerge.pipeline.plan import make_plan
    from specmerge.pipeline.recipe import Recipe

    recipe = Recipe(base=str(models / "base"), experts=[str(models / f"expert{i}") for i in range(4)],
                    method="task_arithmetic", params={"scale": 0.3}, dtype="float16")  # fmt: skip
    timed = {"with check": executor._linear_merge, "without": linear_merge_unchecked}
    best: dict[str, list[float]] = {name: [] for name in timed}
    with contextlib.ExitStack() as stack:
        base = stack.enter_context(sources.open_source(recipe.base))
        experts = [stack.enter_context(sources.open_source(e)) for e in recipe.experts]
        plan = make_plan(recipe, base.infos(), [e.infos() for e in experts], list(recipe.experts))
        for entry in plan:
            inputs = (base.load(entry.name), [e.load(entry.name) for e in experts])
            coefficient = executor._linear_coefficient(entry, len(experts))
            runs: dict[str, list[float]] = {name: [] for name in timed}
            for k in range(repeats + 1):
                for name in list(timed) if k % 2 else list(timed)[::-1]:
                    start = time.perf_counter()
                    timed[name](entry, *inputs, coefficient, torch.float32)
                    if k:  # run 0 warms up
                        runs[name].append(time.perf_counter() - start)
            for name in timed:
                best[name].append(min(runs[name]))
            del inputs
    with_check, without = (sum(best[name]) for name in timed)
    per_tensor = statistics.median(a / b for a, b in zip(best["with check"], best["without"], strict=True))
    print(f"linear merge compute, {len(plan)} tensors, fastest of {repeats} alternating runs per tensor, summed: "
          f"with the check {with_check:.3f} s, without {without:.3f} s, ratio {with_check / without:.4f} "
          f"(median per-tensor ratio {per_tensor:.4f}); torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--finite-check-only", action="store_true", help="time the linear merge's compute only")
    args = parser.parse_args()
    if args.finite_check_only:
        time_finite_check(args.models, args.repeats)
        return
    if "all on" not in args.variants:
        args.variants.insert(0, "all on")
    work = Path(tempfile.mkdtemp(prefix="ablation-", dir=args.models))
    try:
        times: dict[str, list[float]] = {name: [] for name in args.variants}
        for round_ in range(args.repeats + 1):
            for name in args.variants:
                seconds = time_merge(args.models, work / "out", name)
                if round_:  # round 0 warms up
                    times[name].append(seconds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(times["all on"])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; task arithmetic, 1.1B Llama, fp16, "
          f"median of {args.repeats} rounds (in process)\n")  # fmt: skip
    print("| variant | seconds (median) | / all on | per round |")
    print("|---|---:|---:|---|")
    for name, values in times.items():
        median = statistics.median(values)
        rounds = " ".join(f"{v:.2f}" for v in values)
        print(f"| {name} | {median:.2f} | {median / base:.2f} | {rounds} |")

    g = torch.Generator().manual_seed(0)
    tau = (1e-3 * torch.randn(4, 5632 * 2048, generator=g)).to(torch.float16).float()
    timed = {}
    for name, fn in (("before (topk)", ties_before), ("now", lambda t: baselines.ties(t).delta)):
        fn(tau)  # warm-up
        runs = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            result = fn(tau)
            runs.append(time.perf_counter() - start)
        timed[name] = (statistics.median(runs), result)
    (t_before, before), (t_now, now) = timed["before (topk)"], timed["now"]
    differ = float((before != now).double().mean())
    print(f"\nTIES, one 5632 x 2048 tensor, 4 experts: before {t_before:.3f} s, now {t_now:.3f} s "
          f"({t_before / t_now:.1f}x); entries that differ: {differ:.2e} (equal magnitudes at the threshold "
          "are kept by index now, by torch.topk's order before)")  # fmt: skip


if __name__ == "__main__":
    main()
