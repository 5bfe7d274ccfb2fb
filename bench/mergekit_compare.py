"""How far specmerge's output is from mergekit's on each config of the mergekit corpus, run as it is by specmerge's
mergekit dialect (the references of bench/mergekit_reference.py, mergekit 0.1.5).

Deterministic configs: the largest difference as a share of the tensor's largest entry, and how many tensors are
equal bit for bit. Random ones (DARE, DELLA): the distribution statistics of tests/test_mergekit_corpus.py, the share
of entries no expert moved and the merged task vector's size relative to the experts' sum, mergekit's against
specmerge's over 6 seeds (mean and standard deviation). Refused configs: the one-line reason.

    .venv/bin/python bench/mergekit_compare.py
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

import specmerge
from specmerge.errors import RecipeError
from specmerge.pipeline.recipe.mergekit import convert

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from mergekit_inputs import REFERENCES, build_inputs, configs, render, tokenizer_record
from test_mergekit_corpus import RANDOM, RECORDS, SEEDS, by_their_ids, statistics_of


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        inputs = build_inputs(Path(tmp) / "inputs")
        base = load_file(inputs["base"] / "model.safetensors")
        print(f"{'config':26} {'largest difference':>20} {'bit for bit':>12}")
        randoms, refused = [], []
        for config in configs():
            name = config.stem
            try:
                conversion = convert(yaml.safe_load(render(config, inputs)))
            except RecipeError as err:
                refused.append((name, str(err)))
                continue
            theirs = load_file(REFERENCES / f"{name}.safetensors")
            if name in RANDOM:
                experts = [load_file(Path(e) / "model.safetensors") for e in conversion.recipe.experts]
                runs = []
                for seed in range(SEEDS):
                    recipe = conversion.recipe.model_copy(update={"params": {**conversion.recipe.params, "seed": seed}})
                    specmerge.run_recipe(recipe, Path(tmp) / f"{name}-{seed}", progress=False, threads=1)
                    runs.append(statistics_of(load_file(Path(tmp) / f"{name}-{seed}/model.safetensors"), base, experts))
                randoms.append((name, statistics_of(theirs, base, experts), runs))
                continue
            specmerge.run_recipe(conversion.recipe, Path(tmp) / name, progress=False, threads=1)
            ours = load_file(Path(tmp) / name / "model.safetensors")
            if "vocabulary" in RECORDS[name]:  # the added tokens' rows at mergekit's ids (its numbering varies)
                ours = by_their_ids(ours, tokenizer_record(Path(tmp) / name)["vocabulary"], RECORDS[name]["vocabulary"])
            worst = max(
                float((ours[k].double() - theirs[k].double()).abs().max() / theirs[k].double().abs().max())
                for k in theirs
            )
            exact = sum(torch.equal(ours[k], theirs[k]) for k in theirs)
            print(f"{name:26} {worst:>20.1e} {f'{exact}/{len(theirs)}':>12}")
        head = f"{'unmoved: mergekit':>18} {'specmerge':>16} {'size: mergekit':>15} {'specmerge':>16}"
        print(f"\n{'random config':22} {head}")
        for name, (zero_t, size_t, _), runs in randoms:
            zeros, sizes = [z for z, _, _ in runs], [s for _, s, _ in runs]
            z, s = (
                f"{statistics.fmean(zeros):.4f}±{statistics.stdev(zeros):.4f}",
                f"{statistics.fmean(sizes):.4f}±{statistics.stdev(sizes):.4f}",
            )
            print(f"{name:22} {zero_t:>18.4f} {z:>16} {size_t:>15.4f} {s:>16}")
        print()
        for name, reason in refused:
            print(f"refused {name}: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
