"""Time per layer of the merge methods on CLIP-ViT-B/32-shaped layers (N = 8 synthetic experts).

Task vectors are low-rank + noise: tau_i = A_i B_i + noise with rank 32 per expert, noise at 20 % of
the signal norm and entries of size ~1e-3, like real fine-tuning deltas. Each method runs at its
registry defaults (WUDI: 300 Adam steps). Reported: median wall time over --repeats runs after one
warm-up, all methods measured in the same process, one after another, on the same inputs.

    python bench/layer_speed.py                      # the BENCHMARKS.md table
    python bench/layer_speed.py --device cuda --repeats 5
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from specmerge import get_method

# (name, d_out, d_in) as in CLIP-ViT-B/32: attention out_proj, fused in_proj (q,k,v), mlp.fc1, mlp.fc2
SHAPES = [("attn.out_proj", 768, 768), ("attn.in_proj", 2304, 768), ("mlp.fc1", 3072, 768), ("mlp.fc2", 768, 3072)]
METHODS = ["swudi_a", "swudi", "tsv_m", "iso_c", "wudi", "wudi_reference"]


def synthetic_stack(n: int, d_out: int, d_in: int, rank: int = 32, noise: float = 0.2, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    signal = torch.randn(n, d_out, rank, generator=g) @ torch.randn(n, rank, d_in, generator=g)
    fuzz = torch.randn(n, d_out, d_in, generator=g)
    fuzz *= noise * signal.norm(dim=(1, 2), keepdim=True) / fuzz.norm(dim=(1, 2), keepdim=True)
    tau = signal + fuzz
    return 1e-3 * tau / tau.std()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown cpu"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_method(name: str, stack: torch.Tensor, repeats: int) -> tuple[list[float], dict]:
    """Wall times of ``repeats`` runs after one warm-up run, and the warm-up run's diagnostics."""
    method = get_method(name)
    diagnostics = method(stack).diagnostics  # warm-up (allocator, kernels, pydantic model)
    times = []
    for _ in range(repeats):
        sync(stack.device)
        start = time.perf_counter()
        method(stack)
        sync(stack.device)
        times.append(time.perf_counter() - start)
    return times, diagnostics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reference-repeats", type=int, default=1, help="repeats for wudi_reference (slow)")
    parser.add_argument("--methods", nargs="+", default=METHODS)
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    threads = torch.get_num_threads()
    print(f"# torch {torch.__version__}, device {device} ({name}), {threads} threads, float32, N={args.experts}")
    print(f"# median seconds per layer over {args.repeats} runs ({args.reference_repeats} for wudi_reference)\n")
    print("| layer (d_out x d_in) | " + " | ".join(args.methods) + " | K of swudi_a / swudi |")
    print("|---|" + "---:|" * (len(args.methods) + 1))
    ratios = []
    for layer, d_out, d_in in SHAPES:
        stack = synthetic_stack(args.experts, d_out, d_in).to(device)
        medians, kept = {}, {}
        for m in args.methods:
            repeats = args.reference_repeats if m == "wudi_reference" else args.repeats
            times, diagnostics = time_method(m, stack, repeats)
            medians[m], kept[m] = statistics.median(times), diagnostics.get("kept_rank")
        cells = " | ".join(f"{medians[m]:.3g}" for m in args.methods)
        print(f"| {layer} ({d_out}x{d_in}) | {cells} | {kept.get('swudi_a')} / {kept.get('swudi')} |", flush=True)
        if "wudi_reference" in medians:
            ratios.append((layer, {m: medians["wudi_reference"] / medians[m] for m in args.methods}))
    if ratios:
        print("\nSpeed-up over reference-style WUDI-300 (ratio of the medians above):\n")
        print("| layer | " + " | ".join(args.methods) + " |")
        print("|---|" + "---:|" * len(args.methods))
        for layer, row in ratios:
            print(f"| {layer} | " + " | ".join(f"{row[m]:.1f}x" for m in args.methods) + " |")


if __name__ == "__main__":
    main()
