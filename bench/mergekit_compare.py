"""How far specmerge's output is from mergekit's on each config of the corpus that a recipe expresses today
(tests/test_mergekit_corpus.py's EXPRESSED, the references of bench/mergekit_reference.py): the largest difference as
a share of the tensor's largest entry, and how many tensors are equal bit for bit.

    .venv/bin/python bench/mergekit_compare.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

import specmerge

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from mergekit_inputs import REFERENCES, build_inputs
from test_mergekit_corpus import EXPRESSED


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        inputs = build_inputs(Path(tmp) / "inputs")
        print(f"{'config':26} {'largest difference':>20} {'bit for bit':>12}")
        for name, (base, experts, recipe) in sorted(EXPRESSED.items()):
            out = Path(tmp) / name
            specmerge.merge(inputs[base], [inputs[e] for e in experts], out, progress=False, threads=1, **recipe)
            ours, theirs = load_file(out / "model.safetensors"), load_file(REFERENCES / f"{name}.safetensors")
            worst = max(
                float((ours[k].double() - theirs[k].double()).abs().max() / theirs[k].double().abs().max())
                for k in theirs
            )
            exact = sum(torch.equal(ours[k], theirs[k]) for k in theirs)
            print(f"{name:26} {worst:>20.1e} {f'{exact}/{len(theirs)}':>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
