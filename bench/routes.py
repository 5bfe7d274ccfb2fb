"""Before/after timings of the exact routes inside one spectral merge, measured in one run.

    python bench/routes.py            # the BENCHMARKS.md table (CPU)
    python bench/routes.py --device cuda

Each row times an alternative ("before") against the route specmerge takes ("after") on the same
synthetic layer (``specmerge_bench.speed.synthetic_stack``), median of ``--repeats`` after a warm-up, and
reports the largest relative difference between the two results (they are the same quantity):

1. eigen route when N d_out < d_in: eigh of the (N d_out)^2 Gram M M^T (then q_k = M^T u_k / sigma_k)
   instead of eigh of the d_in^2 C;
2. the filtered solve without forming tau_init C: (tau_init Q) diag(lambda) instead of (tau_init C) Q;
3. only the K kept eigenvectors (scipy ``eigh(subset_by_index)``, MRRR) instead of all of them;
4. batching 12 same-shape layers into one batched ``torch.linalg.eigh`` instead of a loop;
5. float64 instead of float32 for the whole SWUDI-A layer (cost, and the float32 error against it);
6. 1 thread instead of torch's default.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import scipy.linalg
import torch

from specmerge.methods.registry import get_method
from specmerge.methods.spectral import choose_rank, decompose, filtered_solve, initial_point, normal_equation
from specmerge_bench.speed import cpu_name, median_seconds, synthetic_stack


def median(fn: Callable[[], object], repeats: int, device: torch.device) -> tuple[float, object]:
    """(median seconds of ``repeats`` calls after a warm-up, the warm-up's result)."""
    out = fn()
    return median_seconds(fn, repeats, device, warm_up=False), out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def row(title: str, before: tuple[float, object], after: tuple[float, object], diff: float | str) -> str:
    diff_text = diff if isinstance(diff, str) else f"{diff:.1e}"
    return f"| {title} | {before[0]:.3g} | {after[0]:.3g} | {before[0] / after[0]:.2f}x | {diff_text} |"


def eigen_route(n: int, d_out: int, d_in: int, repeats: int, device: torch.device) -> str:
    eq = normal_equation(synthetic_stack(n, d_out, d_in).to(device))
    M = eq.M  # shared by both routes, outside the timing

    def via_c() -> torch.Tensor:  # form C = M^T M, all its eigenpairs
        lam, _ = torch.linalg.eigh(M.T @ M)
        return lam.flip(0)[: n * d_out]

    def via_gram() -> torch.Tensor:  # form M M^T, its eigenpairs, then the vectors q_k = M^T u_k / sigma_k
        return decompose(eq).eigenvalues

    before, after = median(via_c, repeats, device), median(via_gram, repeats, device)
    top = slice(0, 64)  # the informative eigenvalues (the tail is noise-level in float32 either way)
    diff = rel(after[1][top], before[1][top])
    return row(f"1. eigenvalues, N={n}, {d_out}x{d_in}: eigh(C) -> eigh(M M^T)", before, after, diff)


def tau_init_product(n: int, d_out: int, d_in: int, repeats: int, device: torch.device) -> str:
    stack = synthetic_stack(n, d_out, d_in).to(device)
    eq, start = normal_equation(stack), initial_point(stack, "sum")
    spectrum = decompose(eq)
    k = choose_rank("psqrt", spectrum)
    gains = torch.zeros_like(spectrum.eigenvalues)
    gains[:k] = 1.0
    Q, lam = spectrum.eigenvectors[:, :k], spectrum.eigenvalues[:k]
    C = eq.C

    def explicit() -> torch.Tensor:
        return start + ((eq.D - start @ C) @ Q / lam) @ Q.T

    def projected() -> torch.Tensor:
        return filtered_solve(eq, spectrum, gains, start)

    before, after = median(explicit, repeats, device), median(projected, repeats, device)
    return row(f"2. filtered solve, N={n}, {d_out}x{d_in}, K={k}: (tau0 C) Q -> (tau0 Q) lambda", before, after,
               rel(after[1], before[1]))  # fmt: skip


def top_k_vectors(n: int, d_out: int, d_in: int, repeats: int) -> str:
    eq = normal_equation(synthetic_stack(n, d_out, d_in))
    C = eq.C
    k = choose_rank("psqrt", decompose(eq))
    array = C.double().numpy()

    def subset() -> torch.Tensor:
        return torch.from_numpy(scipy.linalg.eigh(array, subset_by_index=[d_in - k, d_in - 1], driver="evr")[0])

    def full() -> torch.Tensor:
        return torch.linalg.eigh(C.double())[0][-k:]

    before, after = median(subset, repeats, torch.device("cpu")), median(full, repeats, torch.device("cpu"))
    return row(f"3. top K={k} of {d_in}: scipy subset (MRRR) -> full torch eigh (float64 both)", before, after,
               rel(after[1], before[1]))  # fmt: skip


def batched(count: int, n: int, d: int, repeats: int, device: torch.device) -> str:
    Cs = torch.stack([normal_equation(synthetic_stack(n, d, d, seed=s)).C for s in range(count)]).to(device)

    def batch() -> torch.Tensor:
        return torch.linalg.eigh(Cs)[0]

    def loop() -> torch.Tensor:
        return torch.stack([torch.linalg.eigh(c)[0] for c in Cs])

    before, after = median(batch, repeats, device), median(loop, repeats, device)
    return row(f"4. {count} layers {d}x{d}: one batched eigh -> loop of eigh", before, after, rel(after[1], before[1]))


def precision(n: int, d_out: int, d_in: int, repeats: int, device: torch.device) -> str:
    stack = synthetic_stack(n, d_out, d_in).to(device)
    method = get_method("swudi_a")
    before = median(lambda: method(stack.double()).delta, repeats, device)
    after = median(lambda: method(stack).delta, repeats, device)
    return row(f"5. SWUDI-A, N={n}, {d_out}x{d_in}: float64 -> float32", before, after, rel(after[1], before[1]))


def threads(n: int, d_out: int, d_in: int, repeats: int) -> str:
    stack = synthetic_stack(n, d_out, d_in)
    method, default = get_method("swudi_a"), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        before = median(lambda: method(stack).delta, repeats, torch.device("cpu"))
    finally:
        torch.set_num_threads(default)
    after = median(lambda: method(stack).delta, repeats, torch.device("cpu"))
    return row(f"6. SWUDI-A, N={n}, {d_out}x{d_in}: 1 thread -> {default} threads", before, after,
               rel(after[1], before[1]))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    print(f"# torch {torch.__version__}, {device} ({name}), {torch.get_num_threads()} threads, median of "
          f"{args.repeats} after a warm-up; seconds\n")  # fmt: skip
    print("| route: before -> after (what specmerge does) | before (s) | after (s) | speed-up | max rel. difference |")
    print("|---|---:|---:|---:|---:|")
    lines = [
        lambda: eigen_route(2, 768, 3072, args.repeats, device),
        lambda: eigen_route(2, 2048, 5632, args.repeats, device),
        lambda: tau_init_product(8, 768, 3072, args.repeats, device),
        lambda: tau_init_product(8, 3072, 768, args.repeats, device),
        lambda: batched(12, 8, 768, args.repeats, device),
        lambda: precision(8, 3072, 768, args.repeats, device),
        lambda: precision(8, 768, 3072, args.repeats, device),
    ]
    if device.type == "cpu":
        lines.insert(4, lambda: top_k_vectors(8, 768, 3072, args.repeats))
        lines.append(lambda: threads(8, 3072, 768, args.repeats))
    for line in lines:
        print(line(), flush=True)


if __name__ == "__main__":
    main()
