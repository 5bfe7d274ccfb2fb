"""Issue 23 on a GPU: the decomposition of wide layers (N d_out < d_in), whose SVD route is 10x the floor there.

    python bench/gpu_wide_routes.py        (on a CUDA machine; about 3 minutes on an H100)

On the CPU a wide layer's spectrum comes from the SVD of M through a Householder QR (cheaper than eigh(C) there, and
accurate at the bottom of the spectrum). On a GPU, cuSOLVER's gesvd of a 14336 x 14336 R took 10x the whole floor
of the Qwen2-7B down_proj (bench/compute_floor.py --device cuda --qwen). This compares, on the GPU:

- ``QR + SVD (gesvd)``: today's route (torch's default SVD driver);
- ``QR + SVD (gesvdj)``: the same with cuSOLVER's Jacobi SVD;
- ``eigh(C) first``: the tall layers' route (eigh of C, the accurate SVD only for filters that must invert
  eigenvalues eigh leaves unresolved: ``specmerge.linalg.solve.needs_accurate``).

For each: SWUDI-A (psqrt) and SWUDI (r = 0.65) on a 4 x 768 x 4096 layer against the same merge in float64 on the
CPU (largest relative difference, K against float64's), and seconds on the Qwen2-7B down_proj shape (3584 x 18944,
N = 4). Also the float64 check of the 768 x 3072 fc2 layer on the product and B routes.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from specmerge.linalg import spectrum
from specmerge.methods import get_method
from specmerge_bench.speed import best_seconds, synthetic_stack

sys.path.insert(0, str(Path(__file__).parent))
import compute_floor

ROUTES = {"QR + SVD (gesvd)": (False, None), "QR + SVD (gesvdj)": (False, "gesvdj"), "eigh(C) first": (True, None)}
METHODS = compute_floor.METHODS


@contextlib.contextmanager
def route(name: str) -> Iterator[None]:
    by_eigh, driver = ROUTES[name]
    saved = spectrum.GPU_WIDE_BY_EIGH, spectrum.GPU_SVD_DRIVER
    spectrum.GPU_WIDE_BY_EIGH, spectrum.GPU_SVD_DRIVER = by_eigh, driver
    try:
        yield
    finally:
        spectrum.GPU_WIDE_BY_EIGH, spectrum.GPU_SVD_DRIVER = saved


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.cpu().double() - b.cpu().double()).norm() / b.cpu().double().norm())


def main() -> None:
    device = torch.device("cuda")
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision()
    print(f"# torch {torch.__version__}, {torch.cuda.get_device_name()}, allow_tf32 {tf32[0]}, matmul {tf32[1]}\n")

    stack = synthetic_stack(4, 768, 4096, rank=64, noise=0.2)
    print("## 4 x 768 x 4096 (wide: N d_out = 3072 < 4096), against float64 on the CPU\n")
    print("| route | method | seconds | rel. difference | K | float64 K |\n|---|---|---:|---:|---:|---:|")
    gpu = stack.to(device)
    for method, params in METHODS:
        exact = get_method(method)(stack.double(), **params)
        for name in ROUTES:
            with route(name):
                seconds, result = best_seconds(lambda m=method, p=params: get_method(m)(gpu, **p), 2, device)
            print(f"| {name} | {method} | {seconds:.2f} | {relative(result.delta, exact.delta):.1e} | "
                  f"{result.diagnostics['kept_rank']} | {exact.diagnostics['kept_rank']} |", flush=True)  # fmt: skip

    print("\n## 768 x 3072, N = 8, noise 0.2 (C route), SWUDI-A against float64 on the CPU\n")
    stack = synthetic_stack(8, 768, 3072, rank=64, noise=0.2)
    exact = get_method("swudi_a")(stack.double())
    gpu = stack.to(device)
    product = get_method("swudi_a")(gpu)
    with compute_floor.b_route_only():
        b_route = get_method("swudi_a")(gpu)
    errors = relative(product.delta, exact.delta), relative(b_route.delta, exact.delta)
    print(f"product route {errors[0]:.1e}, B route {errors[1]:.1e} (K {product.diagnostics['kept_rank']}, "
          f"{b_route.diagnostics['kept_rank']}; float64 {exact.diagnostics['kept_rank']})\n", flush=True)  # fmt: skip

    print("## 3584 x 18944, N = 4 (Qwen2-7B down_proj), seconds\n")
    stack = synthetic_stack(4, 3584, 18944, rank=64, noise=0.2).to(device)
    M = stack.reshape(-1, stack.shape[2])
    t_qr, (_, R) = best_seconds(lambda: torch.linalg.qr(M.T), 1, device)
    t_eigh, _ = best_seconds(lambda: torch.linalg.eigh(M.T @ M), 1, device)
    small = R[:4096, :4096].contiguous()
    t_small, _ = best_seconds(lambda: torch.linalg.svd(small, driver="gesvdj"), 1, device)
    projected = t_small * (R.shape[0] / 4096) ** 3
    print(f"QR of M^T {t_qr:.2f} s; eigh(M^T M) {t_eigh:.2f} s; gesvdj of a 4096 block {t_small:.2f} s "
          f"(x {(R.shape[0] / 4096) ** 3:.0f} = {projected:.0f} s projected for R)\n", flush=True)  # fmt: skip
    print("| route | method | seconds | K |\n|---|---|---:|---:|")
    for name in ROUTES:
        if name.endswith("(gesvdj)") and projected > 60:
            print(f"| {name} | | skipped (projected {projected:.0f} s) | |")
            continue
        for method, params in METHODS if name == "eigh(C) first" else METHODS[:1]:
            with route(name):
                start = time.perf_counter()
                result = get_method(method)(stack, **params)
                torch.cuda.synchronize()
                print(f"| {name} | {method} | {time.perf_counter() - start:.2f} | {result.diagnostics['kept_rank']} |",
                      flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
