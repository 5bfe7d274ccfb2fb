"""A small Llama-shaped base and PEFT LoRA adapters of different ranks, for `specmerge inspect` (BENCHMARKS.md).

    python bench/inspect_lora_set.py --out /work/benchdata/inspect-lora

Then: specmerge inspect OUT/base OUT/lora0 OUT/lora1 OUT/lora2 OUT/lora3 --out REPORT_DIR.

Writes OUT/base (LlamaForCausalLM with transformers' random initialisation, hidden 512, 8 layers, grouped
K/V heads, float32) and OUT/lora0..lora3: ranks 4, 8, 16 (rsLoRA) and 8, targeting all seven projections
except that lora3 leaves out the MLP. Like adapters trained on related tasks, the adapters of a layer share
part of their input subspace: each A_i = 0.8 * (random mix of a per-layer shared basis of 8 rows) +
0.6 * (own random rows), rows scaled by 1/sqrt(d_in); B_i ~ N(0, 0.001^2)
(||tau_i|| / ||W_0|| about 1-2%, as real adapters). Everything is seeded.
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import torch

from specmerge_bench.inputs import Parser, fail

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTERS = (
    {"r": 4, "lora_alpha": 8, "targets": ALL},
    {"r": 8, "lora_alpha": 16, "targets": ALL},
    {"r": 16, "lora_alpha": 16, "use_rslora": True, "targets": ALL},
    {"r": 8, "lora_alpha": 16, "targets": ALL[:4]},
)
SHARED_ROWS = 8


def _seed(*parts: object) -> int:
    """A seed from ``parts`` (sha256 of their repr): kept as it is so that the set BENCHMARKS.md reports is rebuilt
    exactly (``specmerge_bench.synthetic.stable_seed`` hashes differently)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


def build_base(folder: Path) -> dict[str, tuple[int, int]]:
    """Save the random base model; return the shapes of its projection weights."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
        vocab_size=1024, max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return {n: tuple(p.shape) for n, p in model.state_dict().items() if n.endswith("proj.weight")}


def build_adapter(folder: Path, index: int, spec: dict, shapes: dict[str, tuple[int, int]], base: Path) -> None:
    """One PEFT adapter folder (adapter_config.json + adapter_model.safetensors) per the module docstring."""
    from safetensors.torch import save_file

    tensors = {}
    for name, (d_out, d_in) in shapes.items():
        if name.rsplit(".", 2)[-2] not in spec["targets"]:
            continue
        shared = torch.randn(SHARED_ROWS, d_in, generator=torch.Generator().manual_seed(_seed("shared", name)))
        g = torch.Generator().manual_seed(_seed("lora", index, name))
        r = spec["r"]
        A = 0.8 * torch.randn(r, SHARED_ROWS, generator=g) @ shared / SHARED_ROWS**0.5 + 0.6 * torch.randn(
            r, d_in, generator=g
        )
        module = f"base_model.model.{name.removesuffix('.weight')}"
        tensors[f"{module}.lora_A.weight"] = (A / d_in**0.5).contiguous()
        tensors[f"{module}.lora_B.weight"] = 0.001 * torch.randn(d_out, r, generator=g)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec["r"], "lora_alpha": spec["lora_alpha"],
        "use_rslora": spec.get("use_rslora", False), "target_modules": list(spec["targets"]),
        "base_model_name_or_path": str(base), "lora_dropout": 0.0, "bias": "none",
    }  # fmt: skip
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    parser = Parser(
        prog="inspect_lora_set.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="folder to write base/ and lora0..lora3/ into")
    args = parser.parse_args()
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} is a file: give a folder (base/ and lora0..lora3/ are written into it)")
    try:
        shapes = build_base(args.out / "base")
        for i, spec in enumerate(ADAPTERS):
            build_adapter(args.out / f"lora{i}", i, spec, shapes, args.out / "base")
            print(f"wrote {args.out / f'lora{i}'} (rank {spec['r']}, {len(spec['targets'])} target projections)")
    except OSError as err:
        fail(parser.prog, f"cannot write under --out {args.out}: {err.strerror or err} ({err.filename or args.out})")


if __name__ == "__main__":
    main()
