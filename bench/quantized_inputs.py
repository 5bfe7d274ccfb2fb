"""Merging quantized checkpoints: what dequantizing on read costs against the same merge from dense inputs.

    python bench/memory.py generate --models DIR                     # the 1.1B Llama set, fp16, base + 4 experts
    python bench/quantized_inputs.py quantize --models DIR --scheme fp8-block    # -> DIR-fp8-block/
    python bench/quantized_inputs.py quantize --models DIR --scheme w4a16        # -> DIR-w4a16/
    python bench/quantized_inputs.py measure --models DIR --schemes fp8-block w4a16 [--json OUT]

`quantize` writes a copy of the set with every decoder-layer projection quantized: ``fp8-block`` as DeepSeek-V3
and the Qwen3 "-FP8" releases store it (float8_e4m3fn codes, a float32 ``weight_scale_inv`` per 128 x 128 block,
``quant_method: fp8``), ``w4a16`` as llm-compressor writes W4A16 (compressed-tensors ``pack-quantized``, 4-bit
symmetric, a scale per group of 128 inputs). `measure` runs, each in a fresh process: the SWUDI-A merge of the
dense set and of each quantized one (seconds, peak anonymous memory above the process's baseline after imports,
with the sampler of bench/memory.py), and a pass that reads every tensor of every input once (dense: as stored;
quantized: dequantized), whose difference is what dequantization adds to a merge. It also gives the relative
Frobenius distance between the merge of a quantized set and the merge of the dense one (the quantization's own
error carried through the merge).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

from specmerge_bench.inputs import Parser, fail, model_family
from specmerge_bench.memory import Sampler

SCHEMES = {
    "fp8-block": {
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
    },
    "w4a16": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128},
            }
        },
        "ignore": ["lm_head"],
    },
}


def quantized_parts(name: str, weight, scheme: str) -> dict:
    """The stored tensors of one quantized 2-D weight (``<module>.<part>`` -> tensor), vectorized."""
    import torch

    module = name[: -len(".weight")]
    w = weight.to(torch.float32)
    rows, cols = w.shape
    if scheme == "fp8-block":  # what --quantize fp8-block writes
        from specmerge.io.quant.output import BLOCK, fp8_codes

        codes, scale = fp8_codes(w, BLOCK)
        return {f"{module}.weight": codes, f"{module}.weight_scale_inv": scale}
    groups = w.reshape(rows, cols // 128, 128)
    scale = (groups.abs().amax(dim=-1) / 7.0).clamp(min=1e-12).to(torch.bfloat16)
    codes = torch.round(groups / scale.float()[..., None]).clamp(-8, 7).reshape(rows, cols).to(torch.int32) + 8
    words = codes.reshape(rows, cols // 8, 8)
    packed = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for j in range(8):  # code i of a row at bit 4i of its run of int32 words
        packed |= words[..., j].to(torch.int64) << (4 * j)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return {
        f"{module}.weight_packed": packed,
        f"{module}.weight_shape": torch.tensor([rows, cols], dtype=torch.int64),
        f"{module}.weight_scale": scale,
    }


def is_projection(name: str, shape: tuple[int, ...]) -> bool:
    return ".layers." in name and name.endswith("_proj.weight") and len(shape) == 2


def quantize_set(models: Path, scheme: str) -> Path:
    """Write MODELS-<scheme>/ with base and experts quantized; return it."""
    from specmerge.io.formats.protocol import TensorInfo
    from specmerge.io.formats.sources import open_source
    from specmerge.io.output.writer import ShardWriter

    target = models.parent / f"{models.name}-{scheme}"
    for folder in [models / "base", *sorted(p for p in models.iterdir() if p.name.startswith("expert"))]:
        out = target / folder.name
        out.mkdir(parents=True, exist_ok=True)
        config = json.loads((folder / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "quantization_config": SCHEMES[scheme]}, indent=2))
        with open_source(folder) as source:
            infos = source.infos()
            stored = {}
            for name, info in infos.items():  # the stored layout, from one tensor's parts (shapes only)
                if is_projection(name, info.shape):
                    import torch

                    parts = quantized_parts(name, torch.zeros(info.shape, dtype=torch.float16), scheme)
                    stored.update({n: TensorInfo(n, tuple(t.shape), t.dtype) for n, t in parts.items()})
                else:
                    stored[name] = info
            with ShardWriter(out, list(stored.values()), max_shard_bytes=10**9) as writer:
                for name, info in infos.items():
                    tensor = source.load(name)
                    parts = quantized_parts(name, tensor, scheme) if is_projection(name, info.shape) else {name: tensor}
                    for part, value in parts.items():
                        writer.write(part, value)
        print(f"wrote {out}", flush=True)
    return target


def merge_job(models: Path, out: Path) -> dict:
    import torch

    from specmerge.pipeline.run.api import merge

    torch.ones(8) @ torch.ones(8)  # thread pools and allocator up before the baseline
    experts = sorted(p for p in models.iterdir() if p.name.startswith("expert"))
    start = time.perf_counter()
    with Sampler() as sampler:
        merge(models / "base", experts, out, method="swudi_a", progress=False, overwrite=True, fsync=False)
    return {"seconds": time.perf_counter() - start, **sampler.result()}


def read_job(models: Path) -> dict:
    """Every tensor of every input read once, as the merge reads it (dequantized where quantized)."""
    from specmerge.io.formats.sources import open_source

    start = time.perf_counter()
    count = 0
    for folder in [models / "base", *sorted(p for p in models.iterdir() if p.name.startswith("expert"))]:
        with open_source(folder) as source:
            for name in source.infos():
                source.load(name)
                count += 1
    return {"seconds": time.perf_counter() - start, "tensors": count}


def distance(merged: Path, reference: Path) -> float:
    """||merged - reference||_F / ||reference||_F over every 2-D projection of two merged models."""
    import torch

    from specmerge.io.formats.sources import open_source

    num = den = 0.0
    with open_source(merged) as a, open_source(reference) as b:
        for name, info in b.infos().items():
            if is_projection(name, info.shape):
                x, y = a.load(name).to(torch.float64), b.load(name).to(torch.float64)
                num += float((x - y).pow(2).sum())
                den += float(y.pow(2).sum())
    return math.sqrt(num / den)


def child(job: str, models: Path, out: Path | None = None) -> dict:
    args = [sys.executable, __file__, job, "--models", str(models), *(["--out", str(out)] if out else [])]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        fail("quantized_inputs.py", f"the {job} job on {models} failed: {lines[-1]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["quantize", "measure", "_merge", "_read"])
    parser.add_argument("--models", type=Path, required=True, help="folder of base/ and expert0/ .. (the dense set)")
    parser.add_argument("--scheme", choices=sorted(SCHEMES), help="quantize: the scheme written")
    parser.add_argument("--schemes", nargs="+", choices=sorted(SCHEMES), default=sorted(SCHEMES))
    parser.add_argument("--out", type=Path, help="_merge: the output folder")
    parser.add_argument("--json", type=Path, help="measure: also write the results to this file")
    args = parser.parse_args()
    model_family(parser, args.models, "expert", generate="python bench/memory.py generate --models DIR")
    if args.command == "quantize":
        if args.scheme is None:
            parser.error("quantize needs --scheme")
        quantize_set(args.models, args.scheme)
    elif args.command == "_merge":
        print(json.dumps(merge_job(args.models, args.out)))
    elif args.command == "_read":
        print(json.dumps(read_job(args.models)))
    else:
        rows = {}
        merged = {}
        for variant in ["dense", *args.schemes]:
            models = args.models if variant == "dense" else args.models.parent / f"{args.models.name}-{variant}"
            if not models.is_dir():
                parser.error(f"{models} is missing: run quantize --scheme {variant} first")
            merged[variant] = args.models.parent / f"merged-{variant}"
            rows[variant] = {"merge": child("_merge", models, merged[variant]), "read": child("_read", models)}
            print(variant, json.dumps(rows[variant]), flush=True)
        dense = rows["dense"]
        print("\n| inputs | merge s | x dense | read-all s | dequantization share of the merge | peak anon GiB | "
              "rel. distance from the dense merge |")  # fmt: skip
        print("|---|---:|---:|---:|---:|---:|---:|")
        for variant, row in rows.items():
            share = (row["read"]["seconds"] - dense["read"]["seconds"]) / row["merge"]["seconds"]
            far = 0.0 if variant == "dense" else distance(merged[variant], merged["dense"])
            row.update(dequantization_share=share, distance_from_dense=far)
            merge_s, peak = row["merge"]["seconds"], row["merge"]["peak_anon_above_baseline_gib"]
            ratio = merge_s / dense["merge"]["seconds"]
            cells = [variant, f"{merge_s:.0f}", f"{ratio:.2f}", f"{row['read']['seconds']:.1f}", f"{share:+.1%}"]
            print("| " + " | ".join([*cells, f"{peak:.2f}", f"{far:.2e}"]) + " |")
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1) + "\n")
        for folder in merged.values():
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
