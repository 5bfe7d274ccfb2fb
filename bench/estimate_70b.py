"""The time of a Llama-70B 4-expert SWUDI-A merge, rebuilt from per-layer figures (issue 50).

    python bench/estimate_70b.py --cpu bench/results/compute_floor/<record>.json

Llama-70B's projections (hidden 8192, intermediate 28672, 8 key-value heads of 128, 80 decoder layers), 4 experts:

- **GPU (H200)**: the device plan (:mod:`specmerge.pipeline.plan.device`) with the H200's measured rates: the
  eigendecomposition interpolated between the sizes measured on it (0.66 s at d = 8192, 3.26 s at 18944; cubic
  beyond, for the down_proj's 28672), C's GEMM at the measured 55 TFLOP/s, copies at an assumed 50 GB/s. Budget: the
  H200's 141 GB less 10 %.
- **CPU**: from a ``compute_floor.py --json`` record of this machine: per part of the floor of its 3072 x 8192 layer
  (C's GEMM, D, eigh), scaled to each 70B shape by its flops (C: N d_out d_in^2; D: N d_out d_in min(d_out, d_in);
  eigh: d_in^3), times the ratio of SWUDI-A's measured time to that floor on the record's layer (of the record's
  3072 x 8192 rows, the one with the larger ratio).

Reading and writing (5 x 140 GB in bf16, and the 140 GB output) are not included: they depend on the storage.
"""

from __future__ import annotations

import json
from pathlib import Path

from specmerge.pipeline.plan.device import H200, LayerShape, default_budget, plan_device
from specmerge_bench.inputs import Parser, fail

HIDDEN, INTERMEDIATE, KV, LAYERS, EXPERTS = 8192, 28672, 1024, 80, 4
SHAPES = {  # (d_out, d_in) of each projection, as the method sees it
    "q_proj": (HIDDEN, HIDDEN),
    "k_proj": (KV, HIDDEN),
    "v_proj": (KV, HIDDEN),
    "o_proj": (HIDDEN, HIDDEN),
    "gate_proj": (INTERMEDIATE, HIDDEN),
    "up_proj": (INTERMEDIATE, HIDDEN),
    "down_proj": (HIDDEN, INTERMEDIATE),
}


def cpu_seconds(record: dict, d_out: int, d_in: int) -> tuple[float, str]:
    """One 70B layer's SWUDI-A seconds on the record's CPU (see the module docstring), and the layer it scales."""
    layers = [r for r in record["layers"] if r["shape"][1:] == [3072, 8192]]
    if not layers:
        fail("estimate_70b.py", "the record has no 3072 x 8192 layer: run compute_floor.py --large --json FILE")
    ref = max(layers, key=lambda r: r["swudi_a"]["seconds"] / r["floor"])  # the dearer row: an upper estimate
    n0, o0, i0 = ref["shape"]
    n = EXPERTS
    c = ref["C"] * (n * d_out * d_in * d_in) / (n0 * o0 * i0 * i0)
    d = ref["D"] * (n * d_out * d_in * min(d_out, d_in)) / (n0 * o0 * i0 * min(o0, i0))
    eigh = ref["eigh"] * (d_in / i0) ** 3
    ratio = ref["swudi_a"]["seconds"] / ref["floor"]
    return ratio * (c + d + eigh), ref["layer"]


def main() -> None:
    parser = Parser(prog="estimate_70b.py", description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", type=Path, required=True, help="a compute_floor.py --large --json record")
    args = parser.parse_args()
    if not args.cpu.is_file():
        parser.error(f"--cpu {args.cpu} is not a file: run python bench/compute_floor.py --large --json FILE first")
    record = json.loads(args.cpu.read_text())
    budget = default_budget(H200.memory)
    shapes = [LayerShape(EXPERTS, d_out, d_in, LAYERS, (name,)) for name, (d_out, d_in) in SHAPES.items()]
    plan = plan_device(shapes, budget, H200, itemsize=4, out_itemsize=2, budget_from="141 GB less 10 %")
    print(f"# Llama-70B, {EXPERTS} experts, SWUDI-A; CPU: {record['cpu']}, {record['where']} ({args.cpu})\n")
    print("| projection | d_out x d_in | H200 s per layer | H200 batch | CPU s per layer |")
    print("|---|---|---:|---:|---:|")
    total_cpu = 0.0
    scaled_from = ""
    for (name, (d_out, d_in)), group in zip(SHAPES.items(), plan.groups, strict=True):
        cpu, scaled_from = cpu_seconds(record, d_out, d_in)
        total_cpu += LAYERS * cpu
        where = f"{group.batch}" if group.batch else "CPU (over the budget)"
        print(f"| {name} | {d_out} x {d_in} | {group.seconds / LAYERS:.2f} | {where} | {cpu:.0f} |")
    print(f"\nwhole model, compute only: H200 {plan.seconds / 60:.1f} min (peak {plan.peak / 1e9:.0f} GB of "
          f"{budget / 1e9:.0f} GB planned); CPU {total_cpu / 3600:.1f} h ({record['where']}, scaled from the "
          f"record's layer '{scaled_from}')")  # fmt: skip


if __name__ == "__main__":
    main()
