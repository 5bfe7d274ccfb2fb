"""Where the time of one SWUDI-A layer goes, and the alternatives we measured for each step.

    python bench/spectral_profile.py

Same kind of synthetic layers as `specmerge-bench speed` (N = 8, float32, CPU). Best of --repeats runs, seconds.
Columns: D and C as built (C in the same pass as D when d_out >= d_in, else a product M^T M after);
the older route for comparison (D alone, then always C = M^T M as a separate product); torch eigh of C; scipy's
partial eigensolver for only the K kept eigenvectors; the filtered solve.
"""

from __future__ import annotations

import functools

import numpy as np
import scipy.linalg
import torch

from specmerge.linalg.filters import TopK
from specmerge.linalg.quadratic import initial_point, nonzero_experts, normal_equation
from specmerge.linalg.solve import filtered_solve
from specmerge.linalg.spectrum import choose_rank, decompose
from specmerge_bench.inputs import Parser
from specmerge_bench.speed import best_seconds as best
from specmerge_bench.speed import synthetic_stack

SHAPES = [(768, 768), (3072, 768), (768, 3072)]


def normal_equation_and_C(stack: torch.Tensor):
    """The normal equation as built, with C formed (in the same pass when d_out >= d_in, else after)."""
    eq = normal_equation(stack)
    _ = eq.C
    return eq


def separate_route(stack: torch.Tensor) -> torch.Tensor:
    """D by the cheaper order per expert, then C = M^T M as its own product (the route before fusing)."""
    tau, norms_sq = nonzero_experts(stack)
    D = stack.new_zeros(stack.shape[1:])
    for tau_i, n_i in zip(tau, norms_sq, strict=True):
        D += ((tau_i @ tau_i.T) @ tau_i if tau_i.shape[0] < tau_i.shape[1] else tau_i @ (tau_i.T @ tau_i)) / n_i
    M = (tau / norms_sq.sqrt()[:, None, None]).reshape(-1, stack.shape[2])
    return M.T @ M


def main() -> None:
    parser = Parser(prog="spectral_profile.py", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per step, the best kept (default 3)")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, float32, N=8, best of {args.repeats}\n")
    print("| layer | D and C (as built) | D, then C = M^T M | eigh(C) | scipy eigh, K vectors | filtered solve | K |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for d_out, d_in in SHAPES:
        stack = synthetic_stack(8, d_out, d_in)
        t_eq, eq = best(functools.partial(normal_equation_and_C, stack), args.repeats)
        t_old, _ = best(functools.partial(separate_route, stack), args.repeats)
        C = eq.C
        t_eigh, _ = best(functools.partial(torch.linalg.eigh, C), args.repeats)
        spectrum = decompose(eq)
        k = choose_rank("psqrt", spectrum)
        c_np = C.numpy().astype(np.float32)
        subset = [d_in - k, d_in - 1]
        partial_eigh = functools.partial(scipy.linalg.eigh, c_np, subset_by_index=subset, driver="evr")
        t_partial, _ = best(partial_eigh, args.repeats)
        start = initial_point(stack, "sum")
        gains = TopK(k)(spectrum.eigenvalues)
        t_solve, _ = best(functools.partial(filtered_solve, eq, spectrum, gains, start), args.repeats)
        print(
            f"| {d_out}x{d_in} | {t_eq:.3f} | {t_old:.3f} | {t_eigh:.3f} | {t_partial:.3f} | {t_solve:.3f} | {k} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
