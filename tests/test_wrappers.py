"""Experts saved with another head or wrapper (issue 15): names matched across wrappers, heads as own modules.

End to end on models built with transformers (a ``BertModel`` base with ``BertForSequenceClassification``
experts; a ``LlamaForCausalLM`` base with ``LlamaForSequenceClassification`` and ``LlamaModel`` experts), and
the name matcher (:func:`specmerge.io.views.name_map.find_name_map`) on name lists of the usual wrappers.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import specmerge
from multimodal_models import build_bert_set, perturbed
from specmerge.cli import main
from specmerge.errors import SpecmergeError
from specmerge.io.formats.sources import open_source
from specmerge.io.views.name_map import NameMapError, find_name_map
from tiny_models import llama_config, save_adapter


def _tensors(folder) -> dict[str, torch.Tensor]:
    with open_source(folder) as source:
        return {name: source.load(name) for name in source.infos()}


@pytest.fixture(scope="module")
def bert_set(tmp_path_factory):
    """BertModel base, classifiers of 2 and 3 labels, and each classifier's encoder saved as a BertModel."""
    root = tmp_path_factory.mktemp("bert")
    paths = build_bert_set(root, labels=(2, 3))
    for name in ("cls0", "cls1"):
        model = transformers.BertForSequenceClassification.from_pretrained(paths[name])
        model.bert.save_pretrained(root / f"{name}-encoder")
        paths[f"{name}-encoder"] = root / f"{name}-encoder"
    return paths


def _merge(paths, experts, out, **options):
    return specmerge.merge(
        paths["base"], [paths[e] for e in experts], out, method="swudi_a", progress=False, threads=1, **options
    )


def test_classifiers_of_a_bert_base(bert_set, tmp_path):
    """``bert.``-prefixed experts of a BertModel base: the encoder is merged as the plain encoders would be, the
    head named by the recipe is taken exactly, and the output loads as the chosen expert's classifier."""
    with pytest.raises(SpecmergeError) as err:  # two heads of different shapes: which one is not guessed
        _merge(bert_set, ["cls0", "cls1"], tmp_path / "out", config_source="cls0")
    assert str(err.value) == (
        "own module tensor 'classifier.bias' has shape (2,) in expert 'cls0' but (3,) in expert 'cls1', so "
        "it cannot be averaged: name its source, e.g. modules: {'classifier.*': cls0} (--module 'classifier.*=cls0')"
    )
    with pytest.raises(
        SpecmergeError,
        match=r"takes 'classifier.bias' of shape \(3,\) from expert 'cls1', but the output's config has it as \(2,\)",
    ):
        _merge(bert_set, ["cls0", "cls1"], tmp_path / "out", config_source="cls0", modules={"classifier.*": "cls1"})
    assert not (tmp_path / "out").exists()

    report = _merge(
        bert_set, ["cls0", "cls1"], tmp_path / "out", config_source="cls0", modules={"classifier.*": "cls0"}
    )
    _merge(bert_set, ["cls0-encoder", "cls1-encoder"], tmp_path / "reference")
    out, reference, head = _tensors(tmp_path / "out"), _tensors(tmp_path / "reference"), _tensors(bert_set["cls0"])
    assert set(out) == {f"bert.{name}" for name in reference} | {"classifier.weight", "classifier.bias"}
    assert all(torch.equal(out[f"bert.{name}"], value) for name, value in reference.items())
    assert torch.equal(out["classifier.weight"], head["classifier.weight"])
    assert torch.equal(out["classifier.bias"], head["classifier.bias"])
    assert report["names"] == {"base": {"exact": 0, "'' -> 'bert.'": len(reference), "unmatched": 0}}
    assert report["modules"] == [
        {"module": "classifier", "tensors": 2, "from": ["cls0"], "how": "copied", "in_config": True,
         "named_by": "modules 'classifier.*'"},
    ]  # fmt: skip

    model = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    assert model.config.num_labels == 2
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[2, 7, 9, 3]])).logits
    assert logits.shape == (1, 2) and torch.isfinite(logits).all()


def test_base_config_keeps_the_expert_names_mapped(bert_set, tmp_path):
    """With the base's config (BertModel) the experts' ``bert.`` is stripped; a head one expert holds is kept as
    its own module (the report says the config lacks it), and the output loads as a BertModel."""
    report = _merge(bert_set, ["cls0", "cls0-encoder"], tmp_path / "out")
    assert report["names"] == {"cls0": {"exact": 0, "'bert.' -> ''": 39, "unmatched": 2}}
    assert report["modules"] == [
        {"module": "classifier", "tensors": 2, "from": ["cls0"], "how": "copied", "in_config": False}
    ]
    assert "config_source" not in report
    transformers.BertModel.from_pretrained(tmp_path / "out")


def _llama_family(root):
    """A LlamaForCausalLM base; a LlamaForSequenceClassification expert (``score`` head, no ``lm_head``) and a
    LlamaModel expert (no ``model.`` prefix, no head), both the base fine-tuned."""
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(llama_config()).eval()
    base.save_pretrained(root / "base")
    state = base.state_dict()
    config = llama_config()
    config.num_labels, config.pad_token_id = 3, 0
    seq = transformers.LlamaForSequenceClassification(config).eval()
    seq.model.load_state_dict(
        {k.removeprefix("model."): v for k, v in perturbed(state, 1).items() if k.startswith("model.")}
    )
    seq.save_pretrained(root / "seq")
    plain = transformers.LlamaModel(llama_config()).eval()
    plain.load_state_dict(
        {k.removeprefix("model."): v for k, v in perturbed(state, 2).items() if k.startswith("model.")}
    )
    plain.save_pretrained(root / "plain")
    return {"base": root / "base", "seq": root / "seq", "plain": root / "plain"}


def test_a_head_instead_of_the_lm_head(tmp_path):
    """config_source names a sequence classifier: the output is one, the base's lm_head (which that config lacks)
    is dropped and reported, the ``score`` head is the expert's; a LlamaModel expert gets ``model.`` added."""
    paths = _llama_family(tmp_path)
    report = _merge(paths, ["seq", "plain"], tmp_path / "out", config_source="seq")
    assert report["dropped"] == [
        {"module": "lm_head", "tensors": 1, "from": "base", "why": "not in the config of expert 'seq'"}
    ]
    assert report["names"] == {"plain": {"exact": 0, "'' -> 'model.'": 20, "unmatched": 0}}
    out = _tensors(tmp_path / "out")
    assert "lm_head.weight" not in out and torch.equal(out["score.weight"], _tensors(paths["seq"])["score.weight"])
    model = transformers.LlamaForSequenceClassification.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert model(input_ids=torch.tensor([[5, 6, 7]])).logits.shape == (1, 3)

    # the base's config: the LlamaModel expert has no lm_head, which is an error as before, unless kept
    with pytest.raises(SpecmergeError, match=r"tensor 'lm_head.weight' is in the base but not in expert '.*plain'"):
        _merge(paths, ["plain"], tmp_path / "lm")
    keep = [{"pattern": "lm_head.weight", "action": "keep_base"}]
    report = _merge(paths, ["plain", "seq"], tmp_path / "lm", overrides=keep, modules={"score.*": "drop"})
    assert report["dropped"] == [{"module": "score", "tensors": 1, "from": "experts", "why": "modules 'score.*': drop"}]
    transformers.LlamaForCausalLM.from_pretrained(tmp_path / "lm")


def test_adapters_hold_no_modules_of_their_own(tmp_path):
    paths = _llama_family(tmp_path)
    paths["lora"] = save_adapter(paths["base"], tmp_path / "lora", seed=3, r=2, target_modules=["q_proj"])
    with pytest.raises(SpecmergeError, match=r"^config_source expert 'lora' is a LoRA adapter: its model's config"):
        _merge(paths, ["seq", "lora"], tmp_path / "out", config_source="lora")
    with pytest.raises(SpecmergeError, match=r"^modules 'score.\*': expert 'lora' is a LoRA adapter, which holds"):
        _merge(paths, ["seq", "lora"], tmp_path / "out", modules={"score.*": "lora"})
    saving = save_adapter(
        paths["base"], tmp_path / "saving", seed=4, r=2, target_modules=["q_proj"], modules_to_save=["lm_head"]
    )
    # its saved lm_head is a copy of a base module (issue 48: merged, as merge_and_unload would), not an own module
    report = _merge({**paths, "saving": saving}, ["lora", "saving"], tmp_path / "out", merge_embeddings=True)
    assert "modules" not in report
    assert {t["name"]: t["action"] for t in report["tensors"]}["lm_head.weight"] == "merge"


def _llama_names(prefix: str = "", layers: int = 2) -> dict[str, tuple[int, ...]]:
    names = {f"{prefix}model.embed_tokens.weight": (64, 32), f"{prefix}model.norm.weight": (32,)}
    for i in range(layers):
        for module, shape in (
            ("self_attn.q_proj", (32, 32)),
            ("self_attn.k_proj", (16, 32)),
            ("mlp.up_proj", (48, 32)),
        ):
            names[f"{prefix}model.layers.{i}.{module}.weight"] = shape
        names[f"{prefix}model.layers.{i}.input_layernorm.weight"] = (32,)
    return names


LLAMA = _llama_names()
WRAPPED = {  # source names, target names, the rewrite found, the name a head the target lacks ends up with
    "peft wrapper": (
        {f"base_model.model.{k}": v for k, v in LLAMA.items()},
        LLAMA,
        "'base_model.model.' -> ''",
        "head.weight",
    ),
    "model. added": (
        {k.removeprefix("model."): v for k, v in LLAMA.items()},
        LLAMA,
        "'' -> 'model.'",
        "model.head.weight",
    ),
    "model.language_model. stripped": (
        {k.replace("model.", "model.language_model.", 1): v for k, v in LLAMA.items()},
        LLAMA,
        "'model.language_model.' -> 'model.'",
        "head.weight",
    ),
    "model.language_model. added": (
        LLAMA,
        {k.replace("model.", "model.language_model.", 1): v for k, v in LLAMA.items()},
        "'model.' -> 'model.language_model.'",
        "head.weight",
    ),
}


@pytest.mark.parametrize(("source", "target", "rewrite", "head"), list(WRAPPED.values()), ids=list(WRAPPED))
def test_wrapper_prefixes_on_name_lists(source, target, rewrite, head):
    """Each wrapper's prefix is found; a head the target lacks keeps its name, under the new prefix when the
    whole source was the wrapped model (old prefix '')."""
    found = find_name_map({**source, "head.weight": (2, 32)}, target, what="expert 'x'", into="the base")
    assert found.summary() == {"exact": 0, rewrite: len(target), "unmatched": 1}
    assert sorted(found.matched) == sorted(target) and found.unmatched() == [head]


def test_name_maps_that_cannot_be_trusted():
    # the same layers twice in the target (a text and a vision stack of equal shapes): either could be meant
    twice = {f"{part}.layers.{i}.{m}.weight": (8, 8) for part in ("text", "vision") for i in range(2) for m in "qk"}
    with pytest.raises(NameMapError) as err:
        find_name_map({f"layers.{i}.{m}.weight": (8, 8) for i in range(2) for m in "qk"}, twice, what="x", into="y")
    assert str(err.value).startswith(
        "the tensor names of x match those of y ambiguously: '' -> 'text.' and '' -> 'vision.' each match 4 tensors"
    )
    # rewrites change wrappers, never a module's own name: classifier.weight does not become score.weight
    found = find_name_map({"classifier.weight": (2, 8)}, {"score.weight": (2, 8)}, what="x", into="y")
    assert found.matched == set() and found.names == {"classifier.weight": "classifier.weight"}
    # what a wrapper holds beyond the target stays under the wrapper's new prefix
    found = find_name_map(
        {"bert.a.weight": (4, 4), "bert.extra.weight": (4, 4)}, {"a.weight": (4, 4)}, what="x", into="y"
    )
    assert found.names == {"a.weight": "bert.a.weight", "extra.weight": "bert.extra.weight"}


def test_a_head_the_output_config_never_loads_is_said_on_the_console(bert_set, tmp_path, capsys):
    """A BertModel base and a classifier expert: the head is kept, but a BertModel config has no place for it
    (report.json said in_config: false, and nothing else did); the console says so, with both ways out."""
    capsys.readouterr()
    out = tmp_path / "out"
    assert main(["merge", str(bert_set["base"]), str(bert_set["cls0"]), "-o", str(out), "-m", "task_arithmetic"]) == 0
    err = capsys.readouterr().err
    assert "module 'classifier' (2 tensors, copied from expert 'cls0') is written, but the output's config" in err
    assert "--config-source cls0" in err and "--module 'classifier.*=drop'" in err
