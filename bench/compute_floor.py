"""SWUDI-A (psqrt) and SWUDI (r = 0.65) per layer against the compute floor of a spectral merge before issue 23.

    python bench/compute_floor.py [--large] [--qwen] [--experts FOLDER] [--models DIR] [--repeats 3] [--device cuda]

The floor is what one spectral merge of a layer cost before the partial eigensolver, each part timed alone with
torch: C = sum_i tau_i^T tau_i / n_i by one GEMM (M^T M, M the stack over sqrt(n_i), formed beforehand), D =
sum_i tau_i A_i by the cheaper order (one expert at a time, general products), and torch.linalg.eigh(C). Against
it, best of --repeats: the whole SWUDI-A and SWUDI merges of the layer (``specmerge.methods``, float32, default
parameters but r), the ratio, and each one's K; and SWUDI-A with the columns B Q by forming B for every count (the
product route of ``specmerge.linalg.projection`` off), for the crossover between the two. The eigvalsh column
(every eigenvalue, no eigenvector) is what any partial eigensolver must still pay for its values.

``--device cuda`` runs it all on the GPU (each timing synchronized; the partial eigensolver is CPU-only, and on a
GPU with fast float64 a float32 layer is decomposed in float64: ``specmerge.linalg.spectrum.float64_spectra``) and
adds, for layers up to 3072 wide, SWUDI-A's largest relative difference from the same merge in float64 on the CPU,
and whether the two keep the same K. Layers:

- synthetic experts like real fine-tunes (``specmerge-bench speed``'s: rank-64 signal + noise): the CLIP-ViT-B/32
  shapes 768 x 768, 3072 x 768 and 768 x 3072 (N = 8) at noise 0.2 (psqrt keeps about 29 %) and 0.01 (16 %);
  ``--large``: Llama-3.2-3B's down_proj, 3072 x 8192, N = 4, at noise 0.2 and 0.01 (psqrt keeps about 12 % and 3.5 %;
  about 10 minutes each on 2 cores); ``--qwen``: Qwen2-7B's,
  3584 x 18944, N = 4 (about an hour, 6 GB);
- ``--experts FOLDER``: real experts, one folder per expert (``model.safetensors``) fine-tuned from ``--base``
  (default: the accuracy benchmark's pinned MiniLM); one layer of each shape, from the last block.

``--accuracy`` (CPU) adds, per layer, SWUDI-A's relative distance from its own float64 merge, the same distance for
the paper's algorithm in float32 (one eigh of C, psqrt K on its eigenvalues, 1 / lambda: :func:`plain_swudi_a`), their
ratio and the three K (issue 50: at most 3x).

``--models DIR`` (``bench/memory.py generate``'s layout: base/, expert0/ ...) adds a whole-model SWUDI-A merge,
run twice in this process: with the partial eigensolver, and with it switched off (every layer through eigh, as
before issue 23); seconds of each, the largest relative difference of a merged tensor, and that tensor's SWUDI-A
merge through each route in float32 against float64 (which route the difference comes from). ``--before-src SRC``
(the ``src/`` folder of an older checkout, e.g. a ``git worktree`` of the commit before issue 23, 1b7c0ec) runs
the same merge with that code first, in a child process (only ``merge`` timed), for before and after in one run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from specmerge.linalg import eigensolver, projection, ritz, solve
from specmerge.methods import get_method
from specmerge_bench.inputs import Parser, fail, model_family, model_folder
from specmerge_bench.speed import best_seconds as best
from specmerge_bench.speed import cpu_name, synthetic_stack

SHAPES = [(8, d_out, d_in, noise) for noise in (0.2, 0.01) for d_out, d_in in ((768, 768), (3072, 768), (768, 3072))]
LARGE = [(4, 3072, 8192, 0.2), (4, 3072, 8192, 0.01)]  # dense noise (psqrt K near 1000), small (K near 300)
QWEN = (4, 3584, 18944, 0.2)
METHODS = (("swudi_a", {}), ("swudi", {"rank_ratio": 0.65}))


def floor_parts(stack: torch.Tensor, repeats: int) -> tuple[float, float, float, float]:
    """Seconds of C by one GEMM, D by the cheaper order, and eigh(C), as a spectral merge formed them before, and
    of eigvalsh(C)."""
    device = stack.device
    norms_sq = stack.flatten(1).pow(2).sum(1)
    M = (stack / norms_sq.sqrt()[:, None, None]).reshape(-1, stack.shape[2])
    t_c, C = best(lambda: M.T @ M, repeats, device)

    def d_by_products() -> torch.Tensor:
        D = stack.new_zeros(stack.shape[1:])
        for tau_i, n_i in zip(stack, norms_sq, strict=True):
            if stack.shape[1] < stack.shape[2]:
                D += (tau_i @ tau_i.T) @ tau_i / n_i
            else:
                D += tau_i @ (tau_i.T @ tau_i) / n_i
        return D

    t_d, _ = best(d_by_products, repeats, device)
    t_eigh, _ = best(lambda: torch.linalg.eigh(C), repeats, device)
    t_values, _ = best(lambda: torch.linalg.eigvalsh(C), repeats, device)
    return t_c, t_d, t_eigh, t_values


@contextlib.contextmanager
def b_route_only() -> Iterator[None]:
    """The columns B Q by forming B for every count (the product route off), as before it existed."""
    chosen = projection.product_pays
    projection.product_pays = lambda *args: False
    try:
        yield
    finally:
        projection.product_pays = chosen


@contextlib.contextmanager
def eigensolver_route(route: str) -> Iterator[None]:
    """``partial``: the partial eigensolver where it pays (the default); ``eigh``: every layer through eigh."""
    size = eigensolver.PARTIAL_MIN_SIZE
    eigensolver.PARTIAL_MIN_SIZE = size if route == "partial" else 10**9
    try:
        yield
    finally:
        eigensolver.PARTIAL_MIN_SIZE = size


CHECKED_WIDTH = 3072  # on a GPU, layers up to this wide are also merged in float64 on the CPU for comparison


def float64_check(stack: torch.Tensor, merged: torch.Tensor, kept: int) -> str:
    """SWUDI-A's largest relative difference from its float64 CPU merge, and whether K agrees."""
    exact = get_method("swudi_a")(stack.cpu().double())
    change = (merged.cpu().double() - exact.delta).norm() / exact.delta.norm()
    same = "same K" if int(exact.diagnostics["kept_rank"]) == kept else f"K {exact.diagnostics['kept_rank']}"
    return f"{float(change):.1e}, {same}"


def plain_swudi_a(stack: torch.Tensor) -> tuple[torch.Tensor, int]:
    """SWUDI-A (psqrt, start at the sum) as the paper's algorithm computes it: one eigh of C in the stack's dtype,
    K by psqrt on its eigenvalues (clipped at 0), tau_hat = tau_sum + (D - tau_sum C) Q_K diag(1 / lambda) Q_K^T."""
    from specmerge.linalg.quadratic import normal_equation
    from specmerge.linalg.rank_rules import psqrt_rank

    eq = normal_equation(stack)
    lam, Q = torch.linalg.eigh(eq.C)
    lam, Q = lam.flip(0).clamp(min=0), Q.flip(1)
    kept = psqrt_rank(lam)
    Q, start = Q[:, :kept], stack.sum(0)
    B = eq.D_times(Q) - start @ (eq.C @ Q)
    return start + (B / lam[:kept]) @ Q.T, kept


@contextlib.contextmanager
def counting_refinements() -> Iterator[list[int]]:
    """Counts the leading-K refinements (:func:`specmerge.linalg.ritz.ritz_refined`) made inside the block."""
    refine, count = solve.ritz_refined, [0]

    def counted(*args, **kwargs):
        count[0] += 1
        return refine(*args, **kwargs)

    solve.ritz_refined = counted
    try:
        yield count
    finally:
        solve.ritz_refined = refine


def accuracy_cells(stack: torch.Tensor, merged: torch.Tensor, kept: int, refined: bool) -> list[str]:
    """SWUDI-A's relative distance from its float64 merge, a plain float32 eigh's (:func:`plain_swudi_a`), their
    ratio, the K of each of the three; and, where the merge refined its K directions (a cut below eigh's floor), the
    seconds and distance of the same merge through the SVD of M instead (the route before issue 50)."""
    exact = get_method("swudi_a")(stack.double())
    plain, plain_kept = plain_swudi_a(stack)
    ours, theirs = ((x.double() - exact.delta).norm() / exact.delta.norm() for x in (merged, plain))
    ks = f"{kept} / {plain_kept} / {int(exact.diagnostics['kept_rank'])}"
    svd = ""
    if refined:
        share, ritz.RITZ_MAX_SHARE = ritz.RITZ_MAX_SHARE, 0.0
        try:
            seconds, before = best(lambda: get_method("swudi_a")(stack), 1)
        finally:
            ritz.RITZ_MAX_SHARE = share
        svd = f"{seconds:.2f} s, {float((before.delta.double() - exact.delta).norm() / exact.delta.norm()):.1e}"
    return [f"{float(ours):.1e}", f"{float(theirs):.1e}", f"{float(ours / theirs):.2f}", ks, svd]


def layer_row(name: str, stack: torch.Tensor, repeats: int, accuracy: bool = False) -> tuple[str, dict]:
    """The layer's markdown row, and its figures for --json."""
    device = stack.device
    t_c, t_d, t_eigh, t_values = floor_parts(stack, repeats)
    floor = t_c + t_d + t_eigh
    record = {"layer": name, "shape": list(stack.shape), "C": t_c, "D": t_d, "eigh": t_eigh, "eigvalsh": t_values,
              "floor": floor}  # fmt: skip
    cells = [name, f"{t_c:.2f}", f"{t_d:.2f}", f"{t_eigh:.2f}", f"{t_values:.2f}", f"{floor:.2f}"]
    for method, params in METHODS:
        with counting_refinements() as refined:
            seconds, result = best(lambda m=method, p=params: get_method(m)(stack, **p), repeats, device)
        kept = int(result.diagnostics["kept_rank"])
        record[method] = {"seconds": seconds, "kept": kept, "refined": refined[0] > 0}
        cells += [f"{seconds:.2f}", f"{seconds / floor:.2f}", str(kept)]
        if method == "swudi_a":
            with b_route_only():
                b_seconds, _ = best(lambda m=method, p=params: get_method(m)(stack, **p), repeats, device)
            cells += [f"{b_seconds:.2f}"]
            if device.type == "cuda":
                cells += [float64_check(stack, result.delta, kept) if max(stack.shape[1:]) <= CHECKED_WIDTH else ""]
            elif accuracy:
                cells += accuracy_cells(stack, result.delta, kept, refined[0] > 0)
                record["accuracy"] = cells[-5:]
    return "| " + " | ".join(cells) + " |", record


def expert_stacks(parser: Parser, folder: Path, base: Path | None) -> list[tuple[str, torch.Tensor]]:
    """One layer of each shape of the last block: (name, N x d_out x d_in task vectors), float32."""
    from safetensors import safe_open

    if base is None:
        from specmerge_bench.accuracy.base_model import load_base_model_path

        base = load_base_model_path()
    base = model_folder(parser, base, "--base")
    experts = sorted(p for p in folder.iterdir() if (p / "model.safetensors").is_file()) if folder.is_dir() else []
    if len(experts) < 2:
        fail(parser.prog, f"--experts {folder} must hold at least two expert folders with model.safetensors")
    with safe_open(base / "model.safetensors", "pt") as f:
        weights = {k: f.get_tensor(k) for k in list(f.keys()) if k.endswith(".weight")}
    with safe_open(experts[0] / "model.safetensors", "pt") as f:
        tuned = list(f.keys())  # layers the experts hold (a base may have more, e.g. a pooler)
    matrices = {k: v for k, v in weights.items()
                if v.dim() == 2 and "embed" not in k and any(t.endswith(k) for t in tuned)}  # fmt: skip
    chosen: dict[tuple[int, ...], str] = {}
    for key in sorted(matrices, key=lambda k: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", k)]):
        chosen[tuple(matrices[key].shape)] = key  # the last block's layer of each shape
    stacks = []
    for shape, key in sorted(chosen.items()):
        rows = []
        for expert in experts:
            with safe_open(expert / "model.safetensors", "pt") as f:
                names = list(f.keys())
                name = key if key in names else next((k for k in names if k.endswith(key)), None)
                if name is None:
                    fail(parser.prog, f"{expert / 'model.safetensors'} has no tensor {key} (the base has it)")
                rows.append(f.get_tensor(name).float() - matrices[key].float())
        stacks.append((f"{key} {shape[0]} x {shape[1]}, N = {len(experts)}", torch.stack(rows)))
    return stacks


BEFORE_JOB = """import sys, time
from specmerge import merge
threads, base, out, *experts = sys.argv[1:]
start = time.perf_counter()
merge(base, experts, out, method="swudi_a", progress=False, threads=int(threads))
print(time.perf_counter() - start)
"""


def largest_change(merged: Path, reference: Path) -> tuple[float, str]:
    """The largest relative Frobenius difference of a tensor of ``merged`` from ``reference``, and its name."""
    from safetensors.torch import load_file

    worst, where = 0.0, ""
    for shard in sorted(merged.glob("*.safetensors")):
        a, b = load_file(shard), load_file(reference / shard.name)
        for key, tensor in a.items():
            change = (tensor.double() - b[key].double()).norm() / b[key].double().norm().clamp_min(1e-300)
            if float(change) > worst:
                worst, where = float(change), key
    return worst, where


def route_accuracy(base: Path, experts: list[Path], name: str) -> None:
    """SWUDI-A on one tensor in float32 with the partial eigensolver and through eigh, each against float64."""
    from specmerge.io.formats.sources import open_source

    def read(folder: Path) -> torch.Tensor:
        with open_source(folder) as source:
            return source.load(name).float()

    weight = read(base)
    stack = torch.stack([read(expert) - weight for expert in experts])
    exact = get_method("swudi_a")(stack.double())
    kept = int(exact.diagnostics["kept_rank"])
    print(f"SWUDI-A on {name} ({stack.shape[1]} x {stack.shape[2]}), float32 against float64 (K {kept}):\n")
    print("| route | seconds | K | against float64 |\n|---|---:|---:|---:|")
    for route in ("partial", "eigh"):
        with eigensolver_route(route):
            start = time.perf_counter()
            result = get_method("swudi_a")(stack)
            seconds = time.perf_counter() - start
        change = (result.delta.double() - exact.delta).norm() / exact.delta.norm()
        print(f"| {route} | {seconds:.1f} | {int(result.diagnostics['kept_rank'])} | {float(change):.1e} |")
    print()


def whole_model(models: Path, parser: Parser, before_src: Path | None) -> None:
    from specmerge import merge

    base, experts = model_family(parser, models, generate="python bench/memory.py generate --models DIR")
    print(f"## Whole-model SWUDI-A (psqrt), {models}: {len(experts)} experts\n")
    print("| route | seconds |\n|---|---:|")
    outputs = {}
    with tempfile.TemporaryDirectory(dir=models.parent) as work:
        if before_src is not None:
            out = Path(work) / "before"
            env = {**os.environ, "PYTHONPATH": str(before_src.resolve())}
            argv = [str(torch.get_num_threads()), str(base), str(out), *map(str, experts)]
            done = subprocess.run([sys.executable, "-c", BEFORE_JOB, *argv], env=env, capture_output=True, text=True)
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["no message"])[-1]
                fail(parser.prog, f"the --before-src merge failed (exit {done.returncode}): {last}")
            print(f"| before ({before_src}) | {float(done.stdout.split()[-1]):.1f} |", flush=True)
            outputs["before"] = out
        for route in ("partial", "eigh"):
            with eigensolver_route(route):
                start = time.perf_counter()
                out = Path(work) / route
                merge(base, experts, out, method="swudi_a", progress=False, threads=torch.get_num_threads())
                seconds = time.perf_counter() - start
            print(f"| {route} | {seconds:.1f} |", flush=True)
            outputs[route] = Path(work) / route
        print()
        for other in [name for name in outputs if name != "partial"]:
            worst, where = largest_change(outputs["partial"], outputs[other])
            print(f"largest relative difference of a merged tensor, partial against {other}: {worst:.1e} ({where})")
    print()
    if where:
        route_accuracy(base, experts, where)


def main() -> None:
    parser = Parser(prog="compute_floor.py", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per step, the best kept (default 3)")
    parser.add_argument("--large", action="store_true",
                        help="add the 3072 x 8192 down_proj layer (N = 4) at noise 0.2 and 0.01")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write each layer's figures to this file (a record)")
    parser.add_argument("--accuracy", action="store_true", help="on the CPU: add SWUDI-A's and a plain float32 "
                        "eigh merge's distance from SWUDI-A in float64, and their ratio")  # fmt: skip
    parser.add_argument("--qwen", action="store_true", help="add a 3584 x 18944 down_proj layer (N = 4)")
    parser.add_argument("--synthetic", action="store_true", help="the CLIP-shaped synthetic layers (default: "
                        "on unless --experts or --models is given)")  # fmt: skip
    parser.add_argument("--experts", type=Path, help="a folder of real expert folders (model.safetensors each)")
    parser.add_argument("--base", type=Path, help="their base model folder (default: the pinned MiniLM)")
    parser.add_argument("--models", type=Path, help="whole-model merges of this base/ + expert*/ set, both routes")
    parser.add_argument("--before-src", type=Path, help="with --models: also merge with this older src/ folder")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where layers are merged and timed (default cpu); cuda adds a float64 check")  # fmt: skip
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    if args.device == "cuda" and args.models is not None:
        parser.error("--models merges on the CPU (the partial eigensolver is CPU-only); leave out --device cuda")
    if args.before_src is not None and not (args.before_src / "specmerge" / "__init__.py").is_file():
        parser.error(f"--before-src {args.before_src} holds no specmerge/ package (give the src/ folder of a checkout)")
    if args.before_src is not None and args.models is None:
        parser.error("--before-src needs --models (it times a whole-model merge)")
    device = torch.device(args.device)
    synthetic = args.synthetic or not (args.experts or args.models or args.large or args.qwen)
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"# torch {torch.__version__}, {where}, float32, best of {args.repeats}\n")
    rows = [(n, d_out, d_in, noise) for n, d_out, d_in, noise in SHAPES if synthetic]
    rows += LARGE if args.large else []
    rows += [QWEN] if args.qwen else []
    layers = [(f"{d_out} x {d_in}, N = {n}, noise {noise}", lambda s=(n, d_out, d_in, noise): synthetic_stack(
        s[0], s[1], s[2], rank=64, noise=s[3])) for n, d_out, d_in, noise in rows]  # fmt: skip
    if args.experts is not None:
        layers += [(name, lambda s=stack: s) for name, stack in expert_stacks(parser, args.experts, args.base)]
    if layers:
        check = " SWUDI-A against float64 |" if device.type == "cuda" else ""
        if args.accuracy and device.type == "cpu":
            check = (" SWUDI-A from float64 | plain eigh from float64 | ratio | K (SWUDI-A / plain / float64) |"
                     " SVD route instead: seconds, from float64 |")  # fmt: skip
        print("| layer | C (GEMM) | D | eigh | eigvalsh | floor | SWUDI-A | / floor | K | SWUDI-A, B route |"
              f"{check} SWUDI r 0.65 | / floor | K |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
              f"{'---:|' * check.count('|')}---:|---:|---:|")  # fmt: skip
        records = []
        for name, make in layers:
            row, record = layer_row(name, make().to(device), args.repeats, args.accuracy)
            print(row, flush=True)
            records.append(record)
            if args.json:  # after every layer: a long run keeps what it measured
                run = {"torch": torch.__version__, "where": where, "cpu": cpu_name(), "repeats": args.repeats}
                args.json.write_text(json.dumps({**run, "layers": records}, indent=1) + "\n")
        print()
    if args.models is not None:
        whole_model(args.models, parser, args.before_src)


if __name__ == "__main__":
    main()
