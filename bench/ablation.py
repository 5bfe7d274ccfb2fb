"""Before/after of each optimisation of issue 6, in one run: switch one off at a time and time the merge.

    python bench/ablation.py --models /work/benchdata/llama1b --repeats 5

Inputs: ``MODELS/base`` and ``MODELS/expert0..3`` (Hugging Face folders written by ``bench/memory.py
generate``). Task arithmetic of the four experts (fp16 output, in this process, so the interpreter's start-up
is not counted): all optimisations on, then with one of them off, each through a public seam of specmerge:

- ``plain reads``: pread into fresh buffers instead of zero-copy memory maps of each tensor's bytes (the
  reader's documented fallback, taken when ``specmerge.io.formats.safetensors_format.mapped`` fails);
- ``fsync at the end only``: no background fdatasync while a shard is written
  (``specmerge.io.output.writer.SYNC_BYTES``, the bytes between background syncs, set beyond any shard);
- ``no fsync``: ``fsync=False`` (``--no-fsync``), for reference.

Variants are interleaved within each round; medians over ``--repeats`` rounds after one warm-up round.
``--variants`` picks some of them (e.g. ``--variants "all on" "no fsync"``).

Then TIES on one 5632 x 2048 tensor of four experts (fp16-valued task vectors: many equal magnitudes): the
previous implementation (``torch.topk`` per expert, an N x tensor disjoint mean) against the registry's
``ties`` (radix-select trim, chunked election and mean), with the outputs compared.

The NaN/Inf-check variant of issue 13 (BENCHMARKS.md) replaced the executor's private linear merge with an
unchecked copy; it was removed with those private functions (issue 14) and is kept in the history
(``git show 60efe03:bench/ablation.py``).
"""

from __future__ import annotations

import contextlib
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from specmerge.io.formats import safetensors_format
from specmerge.io.output import writer
from specmerge.linalg.topk import top_k_count
from specmerge.methods import get_method
from specmerge.pipeline.run.api import merge
from specmerge_bench.inputs import Parser, model_family

EXPERTS = [f"expert{i}" for i in range(4)]


def _no_maps(*args: object) -> torch.Tensor:
    raise OSError("memory maps switched off")


@contextlib.contextmanager
def _switched(module: object, name: str, value: object) -> Iterator[None]:
    """Set a public attribute of a specmerge module for the duration of a block."""
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


VARIANTS: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "all on": contextlib.nullcontext,
    "plain reads": lambda: _switched(safetensors_format, "mapped", _no_maps),
    "fsync at the end only": lambda: _switched(writer, "SYNC_BYTES", 2**62),
    "no fsync": contextlib.nullcontext,
}


def time_merge(models: Path, out: Path, variant: str) -> float:
    shutil.rmtree(out, ignore_errors=True)
    with VARIANTS[variant]():
        start = time.perf_counter()
        merge(
            models / "base",
            [models / name for name in EXPERTS],
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
    k = top_k_count(density, tau.shape[1])
    trimmed = torch.zeros_like(tau)
    for i, tau_i in enumerate(tau):
        keep = tau_i.abs().topk(k, sorted=False).indices
        trimmed[i, keep] = tau_i[keep]
    sign = torch.sign(trimmed.sum(dim=0))
    agree = (torch.sign(trimmed) == sign) & (sign != 0)
    return torch.where(agree, trimmed, 0.0).sum(dim=0) / agree.sum(dim=0).clamp(min=1)


def main() -> None:
    parser = Parser(prog="ablation.py", description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, required=True, help="folder of base/ and expert0/ .. expert3/")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds after a warm-up round (default 5)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    args = parser.parse_args()
    model_family(parser, args.models, EXPERTS, generate="python bench/memory.py generate --models DIR")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
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
    for name, fn in (("before (topk)", ties_before), ("now", lambda t: get_method("ties")(t).delta)):
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
