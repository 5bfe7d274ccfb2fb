"""The partial symmetric eigensolver against torch's eigh: cost against K / d (the crossover), and accuracy.

    python bench/partial_eigensolver.py [--large] [--repeats 3]

Layers like real fine-tunes (`specmerge-bench speed`'s synthetic experts: rank-64 signal + noise), float32, CPU.
C is formed as a merge forms it; then, best of --repeats, seconds: torch.linalg.eigh(C) (every eigenvector),
torch.linalg.eigvalsh(C) (values only, the floor of any method that reads the spectrum), the reduction with every
eigenvalue (:func:`specmerge.linalg.eigensolver.reduce`), and the K leading eigenvectors from it for K at the
psqrt rank and at fixed fractions of d: "partial" is reduction + vectors, against eigh. Accuracy of the kept
vectors at the psqrt K, both solvers: max_k ||C q_k - lambda_k q_k|| / lambda_1 and max |Q^T Q - I|, in float64.
Then a whole SWUDI-A (psqrt) layer both ways, in one process: C formed by products (as before) or symmetric
updates, and the merge on the partial route against the same merge with the partial route switched off (eigh);
``--float64`` adds each one's error against the merge of the float64 stack (relative, Frobenius).
``--large`` adds a Llama-3.2-3B down_proj (3072 x 8192, N = 4): about 6 minutes on 2 cores.
"""

from __future__ import annotations

import torch

from specmerge.linalg import eigensolver
from specmerge.linalg.eigensolver import reduce
from specmerge.linalg.gram import gram_sum
from specmerge.linalg.quadratic import normal_equation
from specmerge.linalg.spectrum import choose_rank, decompose
from specmerge.methods import get_method
from specmerge_bench.inputs import Parser
from specmerge_bench.speed import best_seconds as best
from specmerge_bench.speed import synthetic_stack

# (N, d_out, d_in, noise): the speed benchmark's experts (noise 0.2 x the signal's norm; psqrt keeps 29 %), and
# quieter ones whose psqrt K is the 16 % of the fc2 layer in issue 23
SHAPES = [(8, 768, 3072, 0.2), (8, 768, 3072, 0.01)]
LARGE = (4, 3072, 8192, 0.2)
FRACTIONS = (0.02, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0)


def accuracy(C: torch.Tensor, Q: torch.Tensor, lam: torch.Tensor) -> tuple[float, float]:
    Cd, Qd, lam = C.double(), Q.double(), lam.double()
    residual = float((Cd @ Qd - Qd * lam).norm(dim=0).max() / lam[0])
    orthogonality = float((Qd.T @ Qd - torch.eye(Q.shape[1], dtype=torch.float64)).abs().max())
    return residual, orthogonality


def products(stack: torch.Tensor, norms_sq: torch.Tensor) -> torch.Tensor:
    """C = sum_i tau_i^T tau_i / n_i by general products, as specmerge formed it before symmetric updates."""
    C = stack.new_zeros(stack.shape[2], stack.shape[2])
    for tau_i, n_i in zip(stack, norms_sq, strict=True):
        C.addmm_(tau_i.T, tau_i, alpha=1 / float(n_i))
    return C


def layer_times(stack: torch.Tensor, repeats: int, float64: bool) -> str:
    norms_sq = stack.flatten(1).pow(2).sum(1)
    t_products, _ = best(lambda: products(stack, norms_sq), repeats)
    parts = [(t, 1 / float(n)) for t, n in zip(stack, norms_sq, strict=True)]
    t_symmetric, _ = best(lambda: gram_sum(parts, stack.shape[2], stack), repeats)
    method = get_method("swudi_a")
    t_partial, partial = best(lambda: method(stack), repeats)
    floor = eigensolver.PARTIAL_MIN_SIZE
    eigensolver.PARTIAL_MIN_SIZE = 10**9
    try:
        t_eigh, full = best(lambda: method(stack), repeats)
    finally:
        eigensolver.PARTIAL_MIN_SIZE = floor
    difference = float((partial.delta - full.delta).norm() / full.delta.norm())
    row = (
        f"| {t_products:.2f} | {t_symmetric:.2f} | {t_eigh:.2f} | {t_partial:.2f} | {t_partial / t_eigh:.2f} "
        f"| {partial.diagnostics['kept_rank']} | {difference:.1e} |"
    )
    if float64:
        reference = method(stack.double())
        scale = float(reference.delta.norm())
        errors = [float((r.delta.double() - reference.delta).norm()) / scale for r in (partial, full)]
        row += f" {errors[0]:.1e} | {errors[1]:.1e} | {reference.diagnostics['kept_rank']} |"
    return row


def main() -> None:
    parser = Parser(prog="partial_eigensolver.py", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per step, the best kept (default 3)")
    parser.add_argument("--large", action="store_true", help="add a 3072 x 8192 down_proj layer (N = 4)")
    parser.add_argument("--float64", action="store_true", help="each merge's error against the float64 merge")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, float32, best of {args.repeats}\n")
    shapes = [*SHAPES, *([LARGE] if args.large else [])]
    print("## SWUDI-A (psqrt), one layer, seconds\n")
    extra = (" error, partial | error, eigh | K float64 |", "---:|---:|---:|") if args.float64 else ("", "")
    print("| layer | C by products | C by symmetric updates | merge, eigh | merge, partial | partial / eigh | K "
          f"| relative difference |{extra[0]}\n|---|---:|---:|---:|---:|---:|---:|---:|{extra[1]}")  # fmt: skip
    for n, d_out, d_in, noise in shapes:
        stack = synthetic_stack(n, d_out, d_in, rank=64, noise=noise)
        row = layer_times(stack, args.repeats, args.float64)
        print(f"| {d_out} x {d_in}, N = {n}, noise {noise} {row}", flush=True)
    print()
    for n, d_out, d_in, noise in shapes:
        stack = synthetic_stack(n, d_out, d_in, rank=64, noise=noise)
        eq = normal_equation(stack)
        k_psqrt = choose_rank("psqrt", decompose(eq))
        C = eq.C
        del stack, eq
        t_eigh, (lam, Q) = best(lambda C=C: torch.linalg.eigh(C), args.repeats)
        t_values, _ = best(lambda C=C: torch.linalg.eigvalsh(C), args.repeats)
        t_reduce, reduction = best(lambda C=C: reduce(C), args.repeats)
        head = f"## {d_out} x {d_in}, N = {n}, noise {noise}: eigh {t_eigh:.2f} s, eigvalsh {t_values:.2f} s"
        print(f"{head}, reduction {t_reduce:.2f} s")
        print("\n| K | K / d | vectors (s) | partial (s) | partial / eigh |\n|---:|---:|---:|---:|---:|")
        ks = sorted({k_psqrt, *(max(1, round(f * d_in)) for f in FRACTIONS)})
        for k in ks:
            t_vectors, _ = best(lambda k=k, r=reduction: r.leading_vectors(k), args.repeats)
            total = t_reduce + t_vectors
            mark = " (psqrt)" if k == k_psqrt else ""
            print(f"| {k}{mark} | {k / d_in:.3f} | {t_vectors:.2f} | {total:.2f} | {total / t_eigh:.2f} |", flush=True)
        top = lam.flip(0)[:k_psqrt]
        partial = accuracy(C, reduction.leading_vectors(k_psqrt), top)
        full = accuracy(C, Q.flip(1)[:, :k_psqrt], top)
        gap = float((reduction.eigenvalues.to(lam.dtype) - lam.flip(0)).abs().max() / lam[-1])
        print(
            f"\nkept vectors at K = {k_psqrt}: residual {partial[0]:.1e} (eigh {full[0]:.1e}), "
            f"|Q^T Q - I| {partial[1]:.1e} (eigh {full[1]:.1e}); eigenvalues differ from eigh's by {gap:.1e} lambda_1\n"
        )


if __name__ == "__main__":
    main()
