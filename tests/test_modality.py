"""Modality merging: experts that share the base's language model and carry modules of their own (issue 15).

A Llava-style set built with transformers (tests/multimodal_models.py): a Llama base, Llava experts (the base's
language model fine-tuned, plus a CLIP vision tower and a projector of their own) and a text-only Llama expert.
The Llava checkpoints name the language model ``language_model.model.*`` / ``language_model.lm_head.weight``
(as transformers 5 saves them), so every merge here also maps names across wrappers.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import specmerge
from multimodal_models import IMAGE_TOKEN, build_llava_set
from specmerge.errors import NonFiniteError, RecipeError, SpecmergeError
from specmerge.io.formats.protocol import TensorInfo
from specmerge.io.formats.sources import open_source
from specmerge.io.views.aligned import OwnModulesSource, OwnTensor
from specmerge.io.views.experts import CheckpointExpert
from specmerge.pipeline.plan.rules import PlanError
from tiny_models import save_adapter

OWN_PREFIXES = ("vision_tower.", "multi_modal_projector.")


@pytest.fixture(scope="module")
def llava_set(tmp_path_factory):
    return build_llava_set(tmp_path_factory.mktemp("llava"), n_llava=2)


def _tensors(folder) -> dict[str, torch.Tensor]:
    with open_source(folder) as source:
        return {name: source.load(name) for name in source.infos()}


def _merge(paths, experts, out, **options):
    return specmerge.merge(
        paths["base"], [paths[e] for e in experts], out, method="swudi_a", progress=False, threads=1, **options
    )


def test_llava_expert_merged_with_a_text_expert(llava_set, tmp_path):
    """The acceptance test: the shared language model is merged with swudi_a exactly as a merge of the plain
    Llama checkpoints would merge it, the vision tower and projector are the Llava expert's, bit for bit, the
    output loads as a Llava and runs, and report.json says where each kept module came from."""
    report = _merge(llava_set, ["llava0", "text"], tmp_path / "omni", config_source="llava0")
    _merge(llava_set, ["llava0-lm", "text"], tmp_path / "reference")  # the same tensors, as plain Llamas

    out, reference, expert = (
        _tensors(tmp_path / "omni"),
        _tensors(tmp_path / "reference"),
        _tensors(llava_set["llava0"]),
    )
    assert set(out) == set(expert)  # the Llava's names: the output is a Llava checkpoint
    for name, value in reference.items():
        # Same tensors, same method, one thread: the same arithmetic, so the same bits.
        assert torch.equal(out[f"language_model.{name}"], value), name
    own = [name for name in out if name.startswith(OWN_PREFIXES)]
    assert len(own) == len(out) - len(reference) > 0
    for name in own:
        assert torch.equal(out[name], expert[name]), name

    assert report["config_source"] == "llava0"
    assert report["names"] == {
        who: {"exact": 0, "'' -> 'language_model.'": len(reference), "unmatched": 0} for who in ("base", "text")
    }
    assert report["modules"] == [
        {"module": "multi_modal_projector", "tensors": 4, "from": ["llava0"], "how": "copied", "in_config": True},
        {"module": "vision_tower", "tensors": len(own) - 4, "from": ["llava0"], "how": "copied", "in_config": True},
    ]
    reasons = {t["name"]: t["reason"] for t in json.loads((tmp_path / "omni" / "report.json").read_text())["tensors"]}
    assert {reasons[name] for name in own} == {"own module of expert 'llava0'"}

    model = transformers.LlavaForConditionalGeneration.from_pretrained(tmp_path / "omni").eval()
    loaded = model.state_dict()  # transformers loads the Llava's own modules under model.*
    assert all(torch.equal(loaded[f"model.{name}"], expert[name]) for name in own)
    ids = torch.tensor([[1, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, 5, 6]])
    pixels = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=pixels).logits
    assert logits.shape == (1, 7, 64) and torch.isfinite(logits).all()


def test_two_holders_are_averaged_or_one_is_named(llava_set, tmp_path):
    """Two Llava experts both hold a vision tower: with no recipe entry the output holds their plain average
    (float32 sum in expert order, halved: exact as computed here); ``modules`` names one of them instead."""
    report = _merge(llava_set, ["llava0", "llava1", "text"], tmp_path / "avg", config_source="llava0")
    out, a, b = _tensors(tmp_path / "avg"), _tensors(llava_set["llava0"]), _tensors(llava_set["llava1"])
    for name in (n for n in out if n.startswith(OWN_PREFIXES)):
        assert torch.equal(out[name], (a[name] + b[name]) / 2), name
    assert {m["how"] for m in report["modules"]} == {"averaged"}
    assert {tuple(m["from"]) for m in report["modules"]} == {("llava0", "llava1")}

    named = {"vision_tower.*": "llava1", "multi_modal_projector.*": "llava1"}
    report = _merge(llava_set, ["llava0", "llava1"], tmp_path / "named", config_source="llava0", modules=named)
    out = _tensors(tmp_path / "named")
    for name in (n for n in out if n.startswith(OWN_PREFIXES)):
        assert torch.equal(out[name], b[name]), name
    assert [(m["module"], m["from"], m["named_by"]) for m in report["modules"]] == [
        ("multi_modal_projector", ["llava1"], "modules 'multi_modal_projector.*'"),
        ("vision_tower", ["llava1"], "modules 'vision_tower.*'"),
    ]


def test_dropping_the_own_modules_gives_the_text_merge(llava_set, tmp_path):
    """With the base's config (a Llama) and the Llava's modules dropped, the output is the merge of the language
    models alone, tensor for tensor; without ``drop`` the modules are kept and the report says the config lacks
    them."""
    drop = {"vision_tower.*": "drop", "multi_modal_projector.*": "drop"}
    report = _merge(llava_set, ["llava0", "text"], tmp_path / "text-only", modules=drop)
    _merge(llava_set, ["llava0-lm", "text"], tmp_path / "reference")
    out, reference = _tensors(tmp_path / "text-only"), _tensors(tmp_path / "reference")
    assert out.keys() == reference.keys()
    assert all(torch.equal(out[name], reference[name]) for name in reference)
    assert report["names"]["llava0"] == {"exact": 0, "'language_model.' -> ''": len(reference), "unmatched": 43}
    assert {d["module"]: d["why"] for d in report["dropped"]} == {
        "vision_tower": "modules 'vision_tower.*': drop",
        "multi_modal_projector": "modules 'multi_modal_projector.*': drop",
    }
    transformers.LlamaForCausalLM.from_pretrained(tmp_path / "text-only")  # the base's config

    report = _merge(llava_set, ["llava0", "text"], tmp_path / "kept")
    assert {m["module"]: m["in_config"] for m in report["modules"]} == {
        "vision_tower": False,
        "multi_modal_projector": False,
    }


def test_a_lora_expert_of_the_base_beside_a_llava_expert(llava_set, tmp_path):
    """A LoRA adapter names the base's tensors; with a Llava config_source it is read under the base's new names,
    and its part of the merge is what it is in a merge of the plain Llama checkpoints."""
    lora = save_adapter(llava_set["base"], tmp_path / "lora", seed=5, r=2, target_modules=["q_proj", "v_proj"])
    paths = {**llava_set, "lora": lora}
    report = _merge(paths, ["llava0", "lora"], tmp_path / "omni", config_source="llava0")
    _merge(paths, ["llava0-lm", "lora"], tmp_path / "reference")
    out, reference = _tensors(tmp_path / "omni"), _tensors(tmp_path / "reference")
    assert all(torch.equal(out[f"language_model.{name}"], value) for name, value in reference.items())
    assert set(report["names"]) == {"base"}  # the adapter takes the base's map; it is not listed again


def test_own_module_rows_read_as_the_whole_tensor(llava_set):
    """keep_base work is row-blocked: a block of rows of an own tensor (copied or averaged) is those rows of the
    whole tensor, in the holders' dtype (their promotion when they differ)."""
    name = "vision_tower.encoder.layers.0.mlp.fc1.weight"
    with (
        open_source(llava_set["base"]) as base,
        open_source(llava_set["llava0"]) as a,
        open_source(llava_set["llava1"]) as b,
    ):
        holders = (CheckpointExpert(a), CheckpointExpert(b))
        info = TensorInfo(name, a.infos()[name].shape, torch.float32)
        for own in (
            OwnTensor(info, holders[:1], ("expert 'a'",)),
            OwnTensor(info, holders, ("expert 'a'", "expert 'b'")),
        ):
            view = OwnModulesSource(base, {name: own}, [*base.infos(), name])
            whole = view.load(name)
            assert whole.dtype == torch.float32 and list(view.infos())[-1] == name
            assert torch.equal(view.load(name, (3, 11)), whole[3:11])
        assert torch.equal(whole, (a.load(name) + b.load(name)) / 2)


def test_nan_in_an_own_module_names_its_expert(llava_set, tmp_path):
    from safetensors.torch import save_file

    bad = tmp_path / "bad"
    bad.mkdir()
    tensors = _tensors(llava_set["llava0"])
    tensors["vision_tower.post_layernorm.weight"][3] = float("nan")
    save_file(tensors, bad / "model.safetensors")
    (bad / "config.json").write_text((llava_set["llava0"] / "config.json").read_text())
    paths = {**llava_set, "bad": bad}
    with pytest.raises(NonFiniteError) as err:
        _merge(paths, ["bad", "text"], tmp_path / "out", config_source="bad")
    message = str(err.value)
    assert "'vision_tower.post_layernorm.weight' (own module of expert 'bad')" in message
    assert f"1 of 32 entries in expert 'bad' ({bad})" in message and "\n" not in message
    assert not (tmp_path / "out").exists()


BAD_RECIPES = {
    "unknown config_source": (
        {"config_source": "llava"},
        RecipeError,
        r"unknown config_source 'llava': did you mean 'llava0'\?",
    ),
    "unknown module source": (
        {"modules": {"vision_tower.*": "txt"}},
        RecipeError,
        r"modules 'vision_tower.\*': unknown source 'txt': did you mean 'text'",
    ),
    "source lacks the module": (
        {"modules": {"vision_tower.*": "text"}},
        SpecmergeError,
        r"modules 'vision_tower.\*' takes 'vision_tower\..*' from expert 'text', which does not hold it "
        r"\(held by expert 'llava0'\)",
    ),
    "pattern shadowed": (
        {"modules": {"vision_tower.*": "llava0", "vision_tower.post*": "drop"}},
        SpecmergeError,
        r"modules 'vision_tower.post\*' matches no tensor of the experts' own modules",
    ),
    "pattern on shared tensors": (
        {"modules": {"language_model.*": "llava0"}},
        SpecmergeError,
        r"modules 'language_model.\*' matches only tensors the base has \(e.g. "
        r"'language_model.lm_head.weight'\)",
    ),
    "override on own modules": (
        {"overrides": [{"pattern": "vision_tower.*", "action": "average"}]},
        PlanError,
        r"override 'vision_tower.\*' matches only own modules of experts",
    ),
}


@pytest.mark.parametrize(("options", "error", "expected"), list(BAD_RECIPES.values()), ids=list(BAD_RECIPES))
def test_bad_recipes_are_refused_in_one_line(llava_set, tmp_path, options, error, expected):
    with pytest.raises(error, match=expected) as err:
        _merge(llava_set, ["llava0", "text"], tmp_path / "out", **{"config_source": "llava0", **options})
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_another_architecture_is_refused(llava_set, tmp_path):
    """A BERT expert of a Llama base matches no name under any wrapper: refused, counting what matched."""
    transformers.BertModel(transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                           intermediate_size=48, vocab_size=64)).save_pretrained(tmp_path / "bert")  # fmt: skip
    with pytest.raises(SpecmergeError, match=r"only 0 of the \d+ tensors of expert 'bert' match the tensor names of"):
        specmerge.merge(llava_set["base"], [llava_set["text"], tmp_path / "bert"], tmp_path / "out", progress=False)


def test_config_source_and_modules_from_the_command_line(llava_set, tmp_path, capsys):
    from specmerge.cli import main

    out = tmp_path / "omni"
    inputs = [str(llava_set[name]) for name in ("base", "llava0", "llava1")]
    modules = ["--module", "vision_tower.*=llava0", "--module", "multi_modal_projector.*=llava1"]
    argv = ["merge", *inputs, "-o", str(out), "--config-source", "llava0", *modules, "--threads", "1"]
    assert main(argv) == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert {m["module"]: m["from"] for m in report["modules"]} == {
        "vision_tower": ["llava0"],
        "multi_modal_projector": ["llava1"],
    }
    assert json.loads((out / "config.json").read_text())["model_type"] == "llava"
    recipe = (out / "recipe.yaml").read_text()
    assert "config_source: llava0" in recipe and "vision_tower.*: llava0" in recipe
    # experts named by their paths are written by their keys: no local path in the published recipe
    by_path = ["--config-source", inputs[1], "--module", f"vision_tower.*={inputs[1]}"]
    assert main([*argv[:4], "-o", str(tmp_path / "again"), *by_path, *argv[10:]]) == 0, capsys.readouterr().err
    written = (tmp_path / "again" / "recipe.yaml").read_text()
    assert "config_source: llava0" in written and "vision_tower.*: llava0" in written
    assert str(tmp_path) not in written + (tmp_path / "again" / "README.md").read_text()
    capsys.readouterr()
    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)["properties"]
    assert schema["config_source"]["default"] == "base" and schema["modules"]["type"] == "object"
