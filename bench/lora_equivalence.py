"""The LoRA track's adapter path against the dense merge of the same adapters' merge_and_unload checkpoints.

On the accuracy benchmark's own adapters (``lora-experts/<key>/seed<k>/<task>/``, built by ``specmerge-bench
accuracy --track lora``), for every method with an exact factored form (and WUDI, which takes the dense route on
adapters): ``specmerge.merge`` of the base folder and the adapter folders, against ``specmerge.merge`` of the base
folder and each adapter's ``merge_and_unload`` weights (computed and saved in float64, so that their task
vectors are the adapters' deltas to float64 rounding). Both merges compute in float64 and store float32 (the
base's dtype), so they must agree to the float32 rounding of the result: at most 2 eps32 max|W| per tensor. One
layer is compared (``--layer``, default the last layer's 384 x 1536 output projection); ``--all`` compares
every merged tensor.

    python bench/lora_equivalence.py --cache DIR [--seed 0] [--layer NAME | --all]

Prints one line per method (route on the adapters, largest difference in units of the bound) and exits 1 if
any method is outside it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import peft
import safetensors.torch
import torch

import specmerge
from specmerge_bench.accuracy.base_model import load_base_model_path
from specmerge_bench.accuracy.model import load_base

METHODS = [
    ("weight_average", {}),
    ("task_arithmetic", {}),
    ("tsv_m", {}),
    ("iso_c", {}),
    ("closed_form", {}),
    ("swudi", {"rank_ratio": 0.65, "t": 1300.0}),
    ("swudi_a", {"rule": "psqrt"}),
    ("swudi_a", {"rule": "gavish_donoho"}),
    ("spectral_filter", {}),
    ("wudi", {"steps": 300}),
]
LAYER = "encoder.layer.5.output.dense.weight"


def fail(message: str) -> None:
    """One line on stderr, exit status 2."""
    print(f"lora_equivalence.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def find_adapters(cache: Path, seed: int) -> list[Path]:
    """The adapter folders of ``seed`` in the newest LoRA experts key that has any; a one-line error if none."""
    keys = sorted((cache / "lora-experts").glob(f"*/seed{seed}"), key=lambda p: p.stat().st_mtime)
    for folder in reversed(keys):
        adapters = sorted(p for p in folder.iterdir() if (p / "adapter_model.safetensors").is_file())
        if adapters:
            return adapters
    fail(
        f"{cache} holds no LoRA experts of seed {seed} (lora-experts/*/seed{seed}/); "
        "build them with: specmerge-bench accuracy --cache DIR --track lora"
    )
    return []


def merge_and_unload_float64(base_model, base_dir: Path, adapter: Path, out: Path) -> Path:
    """The adapter's merge_and_unload weights in float64, saved as a model folder; the base file's tensors the
    encoder does not hold (its pooler) are copied as they are."""
    double = base_model.__class__(base_model.config, add_pooling_layer=False)
    double.load_state_dict(base_model.state_dict())
    merged = peft.PeftModel.from_pretrained(double.double(), str(adapter)).merge_and_unload()
    state = {**safetensors.torch.load_file(base_dir / "model.safetensors"), **merged.state_dict()}
    out.mkdir(parents=True)
    safetensors.torch.save_file({k: v.contiguous() for k, v in state.items()}, out / "model.safetensors")
    merged.config.to_json_file(out / "config.json")
    return out


def bound(merged: torch.Tensor) -> float:
    """Two float32 roundings of the stored result: 2 eps32 max|W|."""
    return 2 * torch.finfo(torch.float32).eps * float(merged.abs().max())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache", required=True, type=Path, help="the accuracy benchmark's cache folder")
    parser.add_argument("--seed", type=int, default=0, help="training seed of the adapters (default 0)")
    parser.add_argument("--layer", default=LAYER, help=f"the tensor compared (default {LAYER})")
    parser.add_argument("--all", action="store_true", help="compare every merged tensor instead of one layer")
    args = parser.parse_args(argv)
    if not args.cache.is_dir():
        fail(f"--cache {args.cache} is not a folder")
    adapters = find_adapters(args.cache, args.seed)
    base_dir = load_base_model_path()
    base_model, _ = load_base(base_dir)
    if not args.all and args.layer not in base_model.state_dict():
        fail(f"--layer {args.layer} is not a tensor of the base model")
    compared = "every merged tensor" if args.all else args.layer
    print(f"{len(adapters)} adapters of seed {args.seed} in {adapters[0].parent}; compared: {compared}")
    failed = 0
    with tempfile.TemporaryDirectory(prefix="lora-equivalence-") as work:
        work = Path(work)
        dense = [merge_and_unload_float64(base_model, Path(base_dir), a, work / "dense" / a.name) for a in adapters]
        for i, (method, params) in enumerate(METHODS):
            options = {
                "method": method,
                "params": params,
                "progress": False,
                "fsync": False,
                "compute_dtype": "float64",
            }
            start = time.perf_counter()
            report = specmerge.merge(base_dir, adapters, work / f"a{i}", **options)
            seconds = time.perf_counter() - start
            specmerge.merge(base_dir, dense, work / f"d{i}", **options)
            a = safetensors.torch.load_file(work / f"a{i}" / "model.safetensors")
            d = safetensors.torch.load_file(work / f"d{i}" / "model.safetensors")
            names = [t["name"] for t in report["tensors"] if t["action"] == "merge" and len(t["shape"]) == 2]
            names = names if args.all else [args.layer]
            worst = max(
                float((a[n].double() - d[n].double()).abs().max())
                / (2 * torch.finfo(torch.float32).eps * float(a[n].abs().max()))
                for n in names
            )
            routes = sorted({t["diagnostics"].get("route") for t in report["tensors"] if t["name"] in names})
            failed += worst > 1
            shown = ", ".join(f"{k}={v}" for k, v in params.items())
            print(f"{method}({shown}): route {'/'.join(routes)}, largest difference {worst:.3f} of the bound, "
                  f"adapter merge {seconds:.1f} s {'OK' if worst <= 1 else 'OUTSIDE THE BOUND'}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
