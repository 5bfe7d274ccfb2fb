"""The mergekit corpus (issue 51): mergekit configs of the shapes people publish, with mergekit's own outputs on
tiny models committed as references (bench/mergekit_reference.py, mergekit 0.1.5; no mergekit needed here).

What is checked now:

- every config has its reference, made from this very config (its sha256) and these very inputs (their digest,
  rebuilt here bit for bit);
- the configs that a specmerge recipe already expresses with mergekit's meaning (``EXPRESSED``: the recipe written
  by hand, key by key as docs/mergekit.md maps them) give mergekit's tensors to float32 round-off;
- every other config is listed in ``PENDING`` with what specmerge lacks for it, and the list is exact: a config
  cannot silently drop out of both. ``specmerge run mergekit.yaml`` (the mergekit dialect, next) is to empty it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import specmerge

sys.path.insert(0, str(Path(__file__).parent))
from mergekit_inputs import REFERENCES, build_inputs, config_digest, configs, inputs_digest

RECORDS = json.loads((REFERENCES / "references.json").read_text())
ATTENTION = "*self_attn*"

# config -> (base, experts, recipe keys): mergekit's meaning written as a specmerge recipe.
EXPRESSED: dict[str, tuple[str, list[str], dict]] = {
    "linear-normalized": ("base", ["e0", "e1"], {"method": "linear", "expert_weights": [0.7, 0.3]}),
    "slerp-constant": ("base", ["e1"], {"method": "slerp", "params": {"t": 0.3}}),
    "slerp-gradient-filters": (
        "base",
        ["e0"],
        {
            "method": "slerp",
            "params": {"t": 0.5},
            "overrides": [
                {"pattern": ATTENTION, "params": {"t": [0, 0.5, 0.3, 0.7, 1]}},
                {"pattern": "*mlp*", "params": {"t": [1, 0.5, 0.7, 0.3, 0]}},
            ],
        },
    ),
    "task-arithmetic": (
        "base",
        ["e0", "e1", "e2"],
        {"method": "task_arithmetic", "expert_weights": [0.5, 0.3, 0.2], "params": {"scale": 1.0}},
    ),
    "task-arithmetic-lambda": ("base", ["e0", "e1"], {"method": "task_arithmetic", "params": {"scale": 0.6}}),
    "out-dtype": (
        "base",
        ["e0", "e1"],
        {"method": "task_arithmetic", "expert_weights": [0.5, 0.5], "params": {"scale": 1.0}, "dtype": "bfloat16"},
    ),
    "ties-defaults": ("base", ["e0", "e1"], {"method": "ties", "params": {"density": 1.0}}),
    "model-stock": ("base", ["e0", "e1", "e2"], {"method": "model_stock"}),
    "nearswap": ("base", ["e0"], {"method": "nearswap", "params": {"t": 0.01}}),
    "karcher": ("base", ["e0", "e1", "e2"], {"method": "karcher"}),
    "nuslerp": ("base", ["e0", "e1"], {"method": "nuslerp", "expert_weights": [0.6, 0.4]}),
    "arcee-fusion": ("base", ["e0"], {"method": "arcee_fusion"}),
    "sce": ("base", ["e0", "e1", "e2"], {"method": "sce", "params": {"select_topk": 0.5}}),
    "multislerp-base": ("base", ["e0", "e1", "e2"], {"method": "multislerp", "expert_weights": [1.0, 1.0, 0.5]}),
}

# config -> what specmerge lacks to run it with mergekit's meaning (issue 51).
PENDING: dict[str, str] = {
    "linear-unnormalized": "linear normalize false: mergekit scales the base by sum w_i too",
    "linear-filter-weights": "per-filter expert weights",
    "ties-per-model": "a density per model",
    "ties-density-gradient": "mergekit keeps floor(density n) entries where specmerge's ties keeps ceil",
    "ties-int8-mask": "mergekit keeps floor(density n) entries where specmerge's ties keeps ceil",
    "breadcrumbs": "mergekit's breadcrumbs density and gamma conventions",
    "breadcrumbs-ties": "method breadcrumbs_ties",
    "dare-ties": "dare_ties summing the agreeing entries (normalize false); random masks: compared in distribution",
    "dare-linear": "random masks: compared in distribution",
    "della": "DELLA's L1 rescale; random masks: compared in distribution",
    "della-linear": "DELLA's L1 rescale; random masks: compared in distribution",
    "multislerp": "without base_model, multislerp of the models' own weights: the dialect's base-free form",
    "passthrough-frankenmerge": "slices / layer_range (frankenmerges)",
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return build_inputs(tmp_path_factory.mktemp("mergekit-inputs"))


def test_every_config_has_its_reference_from_these_inputs(inputs):
    names = [c.stem for c in configs()]
    assert len(names) >= 25 and sorted(RECORDS) == sorted(names)
    digest = inputs_digest(inputs)
    for config in configs():
        record = RECORDS[config.stem]
        assert record["config_sha256"] == config_digest(config), f"{config.name} changed: run the reference again"
        assert record["inputs_sha256"] == digest and record["mergekit"] == "0.1.5"
        assert "refused" not in record and (REFERENCES / f"{config.stem}.safetensors").is_file()


def test_every_config_is_compared_or_pending_with_its_reason():
    names = {c.stem for c in configs()}
    assert set(EXPRESSED) | set(PENDING) == names and not set(EXPRESSED) & set(PENDING)


@pytest.mark.parametrize("name", sorted(EXPRESSED))
def test_a_recipe_with_mergekits_meaning_gives_mergekits_tensors(name, inputs, tmp_path):
    base, experts, recipe = EXPRESSED[name]
    specmerge.merge(
        inputs[base],
        [inputs[e] for e in experts],
        tmp_path / "out",
        progress=False,
        threads=1,
        compute_dtype="float32",
        **recipe,
    )
    ours, theirs = load_file(tmp_path / "out/model.safetensors"), load_file(REFERENCES / f"{name}.safetensors")
    assert sorted(ours) == sorted(theirs)
    for tensor_name, expected in theirs.items():
        got = ours[tensor_name]
        assert got.dtype == expected.dtype, tensor_name
        # a few float32 operations on entries of this size apart (or one rounding of the output dtype)
        eps = torch.finfo(expected.dtype).eps
        scale = float(expected.float().abs().max()) + 1
        torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=16 * eps * scale, msg=tensor_name)
