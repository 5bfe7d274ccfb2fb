"""Whole-model LoRA merging: factored vs dense on every adapted layer, and end-to-end merges from files.

    python bench/memory.py generate --models DIR --experts 0      # the ~1.1B Llama base (if not there yet)
    python bench/lora_model.py generate --models DIR               # 5 rank-8 PEFT adapters of DIR/base
    python bench/lora_model.py measure --models DIR                # the table for BENCHMARKS.md

Layout: DIR/base/ (a Hugging Face folder, from `bench/memory.py generate`) and, written by `generate`,
DIR/lora0/ .. lora4/. `generate` writes PEFT LoRA adapter folders DIR/lora0..lora4 (adapter_config.json + float32
adapter_model.safetensors) targeting q, k, v, o, gate, up and down projections of all 22 layers
(154 modules), A ~ N(0, 1/d_in), B ~ N(0, 0.02^2), lora_alpha 16. `measure` runs, each in a fresh
process with peak memory sampled: (1) the merge to a PEFT adapter (`--output-format lora`), (2) the merge
to a dense fp16 model, and (3) for every adapted layer, the method on the factors (the factored route)
and on the dense stack of s_i B_i A_i (what a tool that densifies does: form the deltas, then the
d_in x d_in eigenproblem), with the relative difference of the two results. Job (3) reads the factors
once and times compute only.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from specmerge_bench.inputs import Parser, fail, model_family, model_folder
from specmerge_bench.memory import Sampler
from specmerge_bench.synthetic import stable_seed

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def generate(models: Path, adapters: int, rank: int) -> None:
    import torch
    from safetensors.torch import save_file

    from specmerge.io.formats.sources import open_source

    with open_source(models / "base") as base:
        layers = {n: i.shape for n, i in base.infos().items() if n.rsplit(".", 2)[-2] in TARGETS}
    for k in range(adapters):
        folder = models / f"lora{k}"
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name, (d_out, d_in) in layers.items():
            g = torch.Generator().manual_seed(stable_seed("lora", k, name))
            module = f"base_model.model.{name.removesuffix('.weight')}"
            tensors[f"{module}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) / d_in**0.5
            tensors[f"{module}.lora_B.weight"] = 0.02 * torch.randn(d_out, rank, generator=g)
        save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 16, "use_rslora": False,
                  "fan_in_fan_out": False, "target_modules": list(TARGETS),
                  "base_model_name_or_path": str(models / "base")}  # fmt: skip
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
        print(f"wrote {folder} ({len(layers)} modules, rank {rank})", flush=True)


def adapters_of(models: Path) -> list[Path]:
    return sorted(p for p in models.iterdir() if p.name.startswith("lora") and (p / "adapter_config.json").exists())


def measure_merge(models: Path, out: Path, method: str, output_format: str) -> dict:
    import torch

    from specmerge.pipeline.run.api import merge

    torch.ones(8) @ torch.ones(8)
    start = time.perf_counter()
    with Sampler() as sampler:
        report = merge(models / "base", adapters_of(models), out, method=method, output_format=output_format,
                       progress=False, overwrite=True)  # fmt: skip
    routes = sorted({t["diagnostics"].get("route", "") for t in report["tensors"] if t["action"] == "merge"})
    return {"job": f"merge to {output_format} ({'/'.join(routes)})", "seconds": time.perf_counter() - start,
            **sampler.result()}  # fmt: skip


def measure_layers(models: Path, method: str) -> dict:
    """Factored vs densified method calls on every adapted layer; compute only (factors read beforehand)."""
    import torch

    from specmerge.io.formats.peft import open_adapter
    from specmerge.io.formats.sources import open_source
    from specmerge.io.views.experts import AdapterExpert
    from specmerge.methods import get_method

    torch.ones(8) @ torch.ones(8)
    with open_source(models / "base") as base:
        infos = base.infos()
    experts = [AdapterExpert(open_adapter(p), infos) for p in adapters_of(models)]
    names = [n for n in infos if any(e.changes(n) for e in experts)]
    factored_s = dense_s = 0.0
    worst = 0.0
    with Sampler() as sampler:
        for name in names:
            deltas = [e.load_delta(name) for e in experts]
            start = time.perf_counter()
            fact = get_method(method).merge_factored(deltas)
            factored_s += time.perf_counter() - start
            start = time.perf_counter()
            dense = get_method(method)(torch.stack([d.dense() for d in deltas]))
            dense_s += time.perf_counter() - start
            worst = max(worst, float((fact.dense() - dense.delta).norm() / dense.delta.norm()))
    return {"job": f"{len(names)} layers, factored vs dense", "layers": len(names), "factored_s": factored_s,
            "dense_s": dense_s, "worst_rel_error": worst, **sampler.result()}  # fmt: skip


def child(args: list[str]) -> dict:
    """Run one measuring job of this script in a fresh process; its last stdout line is the JSON result."""
    done = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        fail("lora_model.py", f"the {args[0][1:]} job failed: {lines[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = Parser(prog="lora_model.py", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["generate", "measure", "_merge", "_layers"],
                        help="generate the adapters, or measure (_merge and _layers are its child jobs)")  # fmt: skip
    parser.add_argument("--models", type=Path, required=True, help="folder holding base/ (and the lora*/ adapters)")
    parser.add_argument("--adapters", type=int, default=5, help="adapters to generate (default 5)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank of the generated adapters (default 8)")
    parser.add_argument("--method", default="swudi_a", help="merge method (default swudi_a)")
    parser.add_argument("--format", default="lora", choices=["lora", "model"], help="output of a _merge job")
    parser.add_argument("--out", type=Path, help="output folder of a _merge job")
    args = parser.parse_args()
    if args.adapters < 1 or args.rank < 1:
        parser.error(f"--adapters and --rank must be at least 1, got {args.adapters} and {args.rank}")
    model_folder(parser, args.models / "base", "base model")
    common = ["--models", str(args.models), "--method", args.method]
    if args.command == "generate":
        generate(args.models, args.adapters, args.rank)
        return
    model_family(parser, args.models, "lora", generate="python bench/lora_model.py generate --models DIR")
    if args.command == "_merge":
        print(json.dumps(measure_merge(args.models, args.out, args.method, args.format)))
    elif args.command == "_layers":
        print(json.dumps(measure_layers(args.models, args.method)))
    else:
        import torch

        n = len(adapters_of(args.models))
        print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {n} adapters, method {args.method}")
        layers = child(["_layers", *common])
        print(f"\n{layers['layers']} adapted layers, compute only: factored {layers['factored_s']:.2f} s, "
              f"dense {layers['dense_s']:.1f} s, speed-up {layers['dense_s'] / layers['factored_s']:.0f}x, "
              f"worst relative difference {layers['worst_rel_error']:.1e}\n")  # fmt: skip
        rows = [layers]
        for fmt in ("lora", "model"):
            out = args.models / f"merged-{fmt}"
            rows.append(child(["_merge", *common, "--format", fmt, "--out", str(out)]))
        print("| job | seconds | peak anon above baseline GiB | peak RSS above baseline GiB |")
        print("|---|---:|---:|---:|")
        for r in rows:
            seconds = r.get("seconds", r.get("factored_s", 0) + r.get("dense_s", 0))
            print(f"| {r['job']} | {seconds:.1f} | {r['peak_anon_above_baseline_gib']:.2f} | "
                  f"{r['peak_rss_above_baseline_gib']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
