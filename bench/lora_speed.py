"""Time per layer of factored vs dense SWUDI-A / SWUDI on LoRA experts (Llama-7B-like layer shapes).

    python bench/lora_speed.py            # 5 rank-8 experts, float32, CPU; median of --repeats runs

Dense = the registry method on the stack of B_i A_i (d_out x d_in each, formed inside the timing);
factored = ``specmerge.linalg.lowrank.merge_factored`` on the factors, whose result is checked against the
dense one (relative error printed).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specmerge import get_method
from specmerge.linalg.lowrank import LoraDelta, merge_factored

SHAPES = [("q_proj", 4096, 4096), ("up_proj", 11008, 4096), ("down_proj", 4096, 11008)]


def adapters(n: int, r: int, d_out: int, d_in: int, seed: int = 0) -> list[LoraDelta]:
    g = torch.Generator().manual_seed(seed)
    return [
        LoraDelta(0.01 * torch.randn(d_out, r, generator=g), 0.01 * torch.randn(r, d_in, generator=g), 16.0 / r)
        for _ in range(n)
    ]


def timed(fn, repeats: int):
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=5)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dense-repeats", type=int, default=1)
    parser.add_argument("--methods", nargs="+", default=["swudi_a", "swudi"])
    args = parser.parse_args()
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, float32, N={args.experts}, r={args.rank}")
    print("| layer | method | dense s | factored s | speed-up | rel. error | K dense / factored |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, d_out, d_in in SHAPES:
        experts = adapters(args.experts, args.rank, d_out, d_in)
        for method in args.methods:
            merge_factored(method, experts)  # warm-up
            t_fact, fact = timed(lambda m=method, e=experts: merge_factored(m, e), args.repeats)
            t_dense, dense = timed(
                lambda m=method, e=experts: get_method(m)(torch.stack([x.dense() for x in e])), args.dense_repeats
            )
            error = float((fact.dense() - dense.delta).norm() / dense.delta.norm())
            k = f"{dense.diagnostics['kept_rank']} / {fact.diagnostics['kept_rank']}"
            print(
                f"| {name} ({d_out}x{d_in}) | {method} | {t_dense:.2f} | {t_fact:.4f} | {t_dense / t_fact:.0f}x | "
                f"{error:.1e} | {k} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
