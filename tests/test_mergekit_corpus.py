"""The mergekit corpus (issue 51): mergekit configs of the shapes people publish, run as they are by specmerge's
mergekit dialect and compared with mergekit's own outputs on tiny models (committed references made once by
bench/mergekit_reference.py, mergekit 0.1.5; no mergekit needed here).

- every config has its reference, made from this very config (its sha256) and these very inputs (their digest,
  rebuilt here bit for bit; a second family of models with a tokenizer whose experts add tokens, for the configs
  about tokenizers);
- a config with a tokenizer gives mergekit's vocabulary (``tokenizer_source: union``: the same tokens; their rows
  compared token by token, as mergekit numbers added tokens in an order that changes from run to run) and chat
  template;
- deterministic configs give mergekit's tensors to float32 round-off (``specmerge.merge(mergekit_config=...)``);
- random ones (DARE, DELLA: mergekit draws from torch's global generator, specmerge from its own seeded ones) agree
  in distribution: the share of entries no expert moved (each entry's is a Bernoulli event: within 5 binomial
  standard errors) and the merged task vector's size relative to the experts' sum (within 5 standard deviations of
  specmerge's over several seeds); the same statistics tell a wrong definition (the other ``normalize``) apart;
- the configs specmerge cannot run with mergekit's meaning are refused in one line saying why (``REFUSED``);
- the recipe ``specmerge convert`` prints is itself the recipe that runs (it reads back equal).
Regressions of issue 51's silent differences 2 and 3: omitted keys take mergekit's defaults (``ties-defaults``:
density 1; ``task-arithmetic*``: lambda 1; ``dare-ties``: rescale on, normalize off) and dare_ties sums the agreeing
entries (``dare-ties``, whose statistics tell the sum from the mean).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import specmerge
from specmerge.errors import RecipeError
from specmerge.pipeline.recipe.mergekit import convert
from specmerge.pipeline.recipe.model import Recipe

sys.path.insert(0, str(Path(__file__).parent))
from mergekit_inputs import (
    REFERENCES,
    build_inputs,
    config_digest,
    configs,
    family,
    inputs_digest,
    render,
    tokenizer_record,
)

RECORDS = json.loads((REFERENCES / "references.json").read_text())
RANDOM = ("dare-ties", "dare-linear", "della", "della-linear", "dare-ties-per-model", "della-gradient")
# config -> what the one-line refusal says (what specmerge lacks to run it with mergekit's meaning)
REFUSED: dict[str, str] = {}
SEEDS = 6


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return build_inputs(tmp_path_factory.mktemp("mergekit-inputs"))


def config_data(name: str, inputs: dict[str, Path]) -> dict:
    return yaml.safe_load(render(next(c for c in configs() if c.stem == name), inputs))


def deterministic() -> list[str]:
    return sorted(c.stem for c in configs() if c.stem not in RANDOM and c.stem not in REFUSED)


def test_every_config_has_its_reference_from_these_inputs(inputs):
    names = [c.stem for c in configs()]
    assert len(names) >= 25 and sorted(RECORDS) == sorted(names)
    digests = {names: inputs_digest(inputs, names) for names in {family(c) for c in configs()}}
    for config in configs():
        record = RECORDS[config.stem]
        assert record["config_sha256"] == config_digest(config), f"{config.name} changed: run the reference again"
        assert record["inputs_sha256"] == digests[family(config)] and record["mergekit"] == "0.1.5"
        assert "refused" not in record and (REFERENCES / f"{config.stem}.safetensors").is_file()


@pytest.mark.parametrize("name", deterministic())
def test_a_mergekit_config_gives_mergekits_tensors(name, inputs, tmp_path):
    path = tmp_path / f"{name}.yaml"
    path.write_text(render(next(c for c in configs() if c.stem == name), inputs))
    specmerge.merge(mergekit_config=path, output=tmp_path / "out", progress=False, threads=1)
    ours, theirs = load_file(tmp_path / "out/model.safetensors"), load_file(REFERENCES / f"{name}.safetensors")
    assert sorted(ours) == sorted(theirs)
    layers = json.loads((tmp_path / "out/config.json").read_text())["num_hidden_layers"]
    assert layers == RECORDS[name]["num_hidden_layers"]  # a frankenmerge's count: 6 from two ranges of 3
    if "vocabulary" in RECORDS[name]:  # the tokenizer (union of added tokens) and chat template, as mergekit's
        got = tokenizer_record(tmp_path / "out")
        assert got["chat_template"] == RECORDS[name]["chat_template"]
        ours = by_their_ids(ours, got["vocabulary"], RECORDS[name]["vocabulary"])
    for tensor_name, expected in theirs.items():
        got = ours[tensor_name]
        assert got.dtype == expected.dtype, tensor_name
        # a few float32 operations on entries of this size apart (or one rounding of the output dtype)
        eps = torch.finfo(expected.dtype).eps
        scale = float(expected.float().abs().max()) + 1
        torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=16 * eps * scale, msg=tensor_name)


def by_their_ids(ours: dict, vocabulary: dict[str, int], theirs: dict[str, int]) -> dict:
    """``ours`` with the rows of the embeddings and head put at mergekit's token ids. The same tokens, but mergekit
    numbers the added ones in an order that changes from run to run (its union is built from a Python set of
    strings, whose order follows the process's string hashing); specmerge numbers them in the experts' order."""
    assert sorted(vocabulary) == sorted(theirs)
    order = [vocabulary[token] for token, _ in sorted(theirs.items(), key=lambda item: item[1])]
    rows = len(order)
    return {name: t[order] if t.dim() == 2 and t.shape[0] == rows else t for name, t in ours.items()}


def statistics_of(state: dict, base: dict, experts: list[dict]) -> tuple[float, float, int]:
    """(share of entries equal to the base's, ||merged - base|| / ||sum of the experts' task vectors||, entries)."""
    same = total = 0
    merged_sq = experts_sq = 0.0
    for name, tensor in state.items():
        delta = tensor.double() - base[name].double()
        same += int((delta == 0).sum())
        total += delta.numel()
        merged_sq += float(delta.square().sum())
        experts_sq += float(sum(e[name].double() - base[name].double() for e in experts).square().sum())
    return same / total, math.sqrt(merged_sq / experts_sq), total


@pytest.mark.parametrize("name", RANDOM)
def test_a_random_config_agrees_with_mergekit_in_distribution(name, inputs, tmp_path):
    data = config_data(name, inputs)
    conversion = convert(data)
    base = load_file(inputs["base"] / "model.safetensors")
    experts = [load_file(Path(e) / "model.safetensors") for e in conversion.recipe.experts]
    zero_t, size_t, n = statistics_of(load_file(REFERENCES / f"{name}.safetensors"), base, experts)

    def merged(seed: int, flipped: str = "") -> tuple[float, float, int]:
        params = {**conversion.recipe.params, "seed": seed}
        if flipped:
            params[flipped] = not params[flipped]
        recipe = conversion.recipe.model_copy(update={"params": params})
        specmerge.run_recipe(recipe, tmp_path / f"out-{seed}-{flipped}", progress=False, threads=1)
        return statistics_of(load_file(tmp_path / f"out-{seed}-{flipped}/model.safetensors"), base, experts)

    ours = [merged(seed) for seed in range(SEEDS)]
    zero_o = statistics.fmean(z for z, _, _ in ours)
    # the shares are means of n Bernoulli events; their variance is at most p (1 - p) / n each
    p = (zero_o + zero_t) / 2
    assert abs(zero_o - zero_t) <= 5 * math.sqrt(p * (1 - p) / n * (1 + 1 / SEEDS)) + 1 / n
    sizes = [s for _, s, _ in ours]
    spread = statistics.stdev(sizes) * math.sqrt(1 + 1 / SEEDS)
    assert abs(size_t - statistics.fmean(sizes)) <= 5 * spread, (size_t, sizes)
    for flipped in ("rescale", "normalize") if name == "dare-ties" else ("rescale",):  # the statistic has the power
        wrong = merged(0, flipped)[1]  # to tell a definition with the other rescale (normalize: sum or mean) apart
        assert abs(wrong - statistics.fmean(sizes)) > 5 * spread, (flipped, wrong, sizes)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_cannot_run_with_mergekits_meaning_is_refused_in_one_line(name, inputs, tmp_path):
    path = tmp_path / f"{name}.yaml"
    path.write_text(render(next(c for c in configs() if c.stem == name), inputs))
    with pytest.raises(RecipeError) as caught:
        specmerge.merge(mergekit_config=path, output=tmp_path / "out", progress=False)
    message = str(caught.value)
    assert REFUSED[name] in message and "\n" not in message and str(path) in message
    assert not (tmp_path / "out").exists()


def test_every_config_is_compared_or_refused():
    names = {c.stem for c in configs()}
    assert set(RANDOM) <= names and set(REFUSED) <= names
    assert len(deterministic()) + len(RANDOM) + len(REFUSED) == len(names)


@pytest.mark.parametrize("name", [c.stem for c in configs() if c.stem not in REFUSED])
def test_the_printed_recipe_is_the_recipe_that_runs(name, inputs):
    conversion = convert(config_data(name, inputs))
    text = conversion.to_yaml(name)
    assert text.startswith("# specmerge recipe converted from the mergekit config")
    assert Recipe.from_dict(yaml.safe_load(text)) == conversion.recipe
