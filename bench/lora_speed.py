"""Time per layer of factored vs dense SWUDI-A / SWUDI on LoRA experts (Llama-7B-like layer shapes).

    python bench/lora_speed.py            # 5 rank-8 experts, float32, CPU; median of --repeats runs

Synthetic inputs (no files): N random LoRA experts (B_i, A_i) per layer shape. Dense = the registry method on
the stack of B_i A_i (d_out x d_in each, formed inside the timing); factored = ``Method.merge_factored`` on
the factors, whose result is checked against the dense one (relative error printed).
"""

from __future__ import annotations

import statistics
import time

import torch

from specmerge import all_methods, get_method
from specmerge.linalg.lowrank import LoraDelta
from specmerge_bench.inputs import Parser

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
    parser = Parser(prog="lora_speed.py", description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=5, help="LoRA experts per layer (default 5)")
    parser.add_argument("--rank", type=int, default=8, help="their rank (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="timed factored runs (median)")
    parser.add_argument("--dense-repeats", type=int, default=1, help="timed dense runs (median)")
    factored = [name for name, method in all_methods().items() if method.factored]
    parser.add_argument("--methods", nargs="+", default=["swudi_a", "swudi"], choices=factored, metavar="METHOD",
                        help=f"exact on LoRA factors (default swudi_a swudi): {', '.join(factored)}")  # fmt: skip
    shapes = [name for name, *_ in SHAPES]
    parser.add_argument("--shapes", nargs="+", default=shapes, choices=shapes,
                        help="layer shapes (default all: Llama-7B q_proj, up_proj, down_proj)")  # fmt: skip
    args = parser.parse_args()
    if min(args.experts, args.rank, args.repeats, args.dense_repeats) < 1:
        parser.error("--experts, --rank, --repeats and --dense-repeats must be at least 1")
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, float32, N={args.experts}, r={args.rank}")
    print("| layer | method | dense s | factored s | speed-up | rel. error | K dense / factored |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, d_out, d_in in SHAPES:
        if name not in args.shapes:
            continue
        experts = adapters(args.experts, args.rank, d_out, d_in)
        for method in map(get_method, args.methods):
            method.merge_factored(experts)  # warm-up
            t_fact, fact = timed(lambda m=method, e=experts: m.merge_factored(e), args.repeats)
            t_dense, dense = timed(
                lambda m=method, e=experts: m(torch.stack([x.dense() for x in e])), args.dense_repeats
            )
            error = float((fact.dense() - dense.delta).norm() / dense.delta.norm())
            k = f"{dense.diagnostics['kept_rank']} / {fact.diagnostics['kept_rank']}"
            print(
                f"| {name} ({d_out}x{d_in}) | {method.name} | {t_dense:.2f} | {t_fact:.4f} | {t_dense / t_fact:.0f}x | "
                f"{error:.1e} | {k} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
