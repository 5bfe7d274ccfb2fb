"""Experts that are not what the base is (issue 48, item 7): another architecture is refused before any work, a
field that changes what the same weights compute is said on the console."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from specmerge.cli import main
from specmerge.io.hub.ids import InputResolution
from specmerge.pipeline.inputs.configs import names_base
from specmerge.pipeline.run.api import merge
from test_safety_inputs import cli_error
from tiny_models import llama_config, save_adapter

FAST = {"progress": False, "fsync": False}


def save_llama(folder: Path, seed: int, **changes) -> Path:
    config = llama_config()
    for key, value in changes.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return save_llama(tmp_path_factory.mktemp("configs") / "base", 0)


def test_an_expert_with_a_third_layer_is_refused_unless_it_is_the_config_source(base, tmp_path, capsys):
    deeper = save_llama(tmp_path / "deeper", 1, num_hidden_layers=3)
    same = save_llama(tmp_path / "same", 2)
    out = tmp_path / "out"
    capsys.readouterr()  # transformers' own progress output while saving
    err = cli_error(["merge", str(base), str(deeper), str(same), "-o", str(out), "-q", "-m", "task_arithmetic"], capsys)
    assert f"expert '{deeper}' is not the base's architecture" in err
    assert "num_hidden_layers = 3 where the base's has 2" in err and "config_source" in err
    assert not out.exists()
    # named as the config source, the output is built on its architecture: its third layer is its own
    merge(base, [deeper, same], out, method="task_arithmetic", config_source=str(deeper), **FAST)
    model, info = transformers.LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert model.config.num_hidden_layers == 3 and not info["missing_keys"]


def test_an_expert_with_its_own_head_over_a_tied_base_is_refused(tmp_path, capsys):
    tied = save_llama(tmp_path / "tied", 0, tie_word_embeddings=True)
    untied = save_llama(tmp_path / "untied", 1, tie_word_embeddings=False)
    capsys.readouterr()
    err = cli_error(["merge", str(tied), str(untied), "-o", str(tmp_path / "out"), "-q"], capsys)
    assert "tie_word_embeddings = False where the base's has True" in err


def edited(src: Path, folder: Path, field: str, value) -> Path:
    """A copy of the model folder ``src`` whose config.json states ``value`` for ``field`` (rope_theta: where this
    transformers keeps it, top level or in rope_parameters)."""
    folder.mkdir()
    for f in src.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    if field == "rope_theta" and isinstance(config.get("rope_parameters"), dict):
        config["rope_parameters"] = {**config["rope_parameters"], "rope_theta": value}
    else:
        config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(("field", "value"), [("rope_theta", 50000.0), ("hidden_act", "gelu")])
def test_a_semantic_difference_is_said_with_the_value_the_output_takes(base, tmp_path, capsys, field, value):
    changed = edited(save_llama(tmp_path / "changed0", 1), tmp_path / "changed", field, value)
    other = save_llama(tmp_path / "other", 2)
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["merge", str(base), str(changed), str(other), "-o", str(out), "-m", "task_arithmetic"]) == 0
    err = capsys.readouterr().err
    assert (
        f"expert '{changed}' has " in err and repr(value) in err and "the output's config.json takes the base's" in err
    )
    (difference,) = json.loads((out / "report.json").read_text())["config_differences"]
    assert difference["field"] in (field, "rope_parameters") and difference["expert"] == "changed"
    written = json.loads((out / "config.json").read_text())
    assert value not in (written.get(field), (written.get("rope_parameters") or {}).get(field))  # the base's


def test_an_unrelated_model_given_as_an_expert_is_warned_with_figures(base, tmp_path, capsys):
    """A random initialisation of the same architecture is about 1.4 apart from the base; fine-tunes are not."""
    stranger = save_llama(tmp_path / "stranger", 7)  # same config, another seed: not a fine-tune of the base
    tuned = tmp_path / "tuned"
    model = transformers.LlamaForCausalLM.from_pretrained(base)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * p.std() * torch.randn_like(p))
    model.save_pretrained(tuned)
    capsys.readouterr()
    assert (
        main(["merge", str(base), str(stranger), str(tuned), "-o", str(tmp_path / "o"), "-m", "task_arithmetic"]) == 0
    )
    err = capsys.readouterr().err
    assert f"expert '{stranger}' does not look fine-tuned from this base" in err and "1.4" in err
    assert f"expert '{tuned}'" not in err
    (far, near) = json.loads((tmp_path / "o" / "report.json").read_text())["relatedness"]
    assert far["median"] > 1.2 and near["median"] < 0.05


def test_an_adapter_trained_on_another_base_is_warned(base, tmp_path, capsys):
    adapter = save_adapter(base, tmp_path / "lora", 3, r=2, target_modules=["q_proj"])
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "some-other-model")
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["merge", str(base), str(adapter), "-o", str(tmp_path / "o"), "-m", "task_arithmetic"]) == 0
    err = capsys.readouterr().err
    assert f"adapter '{adapter}' was trained on '{tmp_path / 'some-other-model'}'" in err, err
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    assert report["adapters_of_other_bases"][0] == {
        "adapter": "lora",
        "trained_on": "a local folder",
        "base": "a local folder",
    }


def test_which_names_may_be_the_base():
    hub = InputResolution("org/model", Path("/cache/snap"), "hub", repo_id="org/Model")
    local = InputResolution("./m", Path("/models/m"), "local")
    assert names_base("org/model", hub) and not names_base("org/other", hub) and not names_base("/models/m", hub)
    assert names_base("/models/m", local) and not names_base("/models/n", local)
    assert names_base("org/model", local)  # a hub id and a local folder: what the folder holds is not told by names


def test_an_expert_whose_tokenizer_gives_tokens_other_ids_is_matched_by_token(tmp_path):
    """The same vocabulary size, two tokens' ids swapped (and their rows with them): the rows are matched by token
    string, as for experts with added tokens, not merged by id."""
    import shutil

    from safetensors.torch import save_file

    from token_models import build, weights

    base, experts = build(tmp_path / "tok")
    chat = experts[2]
    swapped = tmp_path / "swapped"
    shutil.copytree(chat, swapped)
    data = json.loads((swapped / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(data))
    state = weights(chat)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        state[name] = state[name][[*range(10), 11, 10, *range(12, state[name].shape[0])]].contiguous()
    for f in swapped.glob("*.safetensors"):
        f.unlink()
    save_file(state, swapped / "model.safetensors", metadata={"format": "pt"})
    merge(base, [swapped], tmp_path / "a", method="task_arithmetic", merge_embeddings=True, **FAST)
    merge(base, [chat], tmp_path / "b", method="task_arithmetic", merge_embeddings=True, **FAST)
    got, want = weights(tmp_path / "a"), weights(tmp_path / "b")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)


def test_a_classifier_head_the_base_config_does_not_load_is_said_with_the_fix(tmp_path, capsys):
    """Issue 49, item 4: `specmerge merge BERT-base BERT-classifier-expert` writes the expert's head under names a
    BertModel config never loads: the console says so and names both fixes; with the fix the head is loaded."""
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=50, num_labels=3)  # fmt: skip
    torch.manual_seed(0)
    encoder = transformers.BertModel(config)
    encoder.save_pretrained(tmp_path / "base")
    classifier = transformers.BertForSequenceClassification(config)
    classifier.bert.load_state_dict(encoder.state_dict())
    classifier.save_pretrained(tmp_path / "cls")
    capsys.readouterr()
    out = tmp_path / "out"
    assert main(["merge", str(tmp_path / "base"), str(tmp_path / "cls"), "-o", str(out), "-q"]) == 0
    err = capsys.readouterr().err
    assert "module 'classifier' (2 tensors, copied from expert 'cls') is written, but the output's config" in err
    assert f"--config-source {tmp_path / 'cls'}" in err or "--config-source cls" in err
    assert "--module 'classifier.*=drop'" in err
    report = json.loads((out / "report.json").read_text())
    assert {t["name"] for t in report["tensors"] if "own module" in t["reason"]} == {"classifier.weight",
                                                                                    "classifier.bias"}  # fmt: skip
    # with the fix the output is the classifier, its head loaded
    fixed = tmp_path / "fixed"
    config_source = str(tmp_path / "cls")
    assert main(["merge", str(tmp_path / "base"), config_source, "-o", str(fixed), "-q",
                 "--config-source", config_source]) == 0  # fmt: skip
    model, info = transformers.BertForSequenceClassification.from_pretrained(fixed, output_loading_info=True)
    assert not info["missing_keys"] and torch.equal(model.classifier.weight, classifier.classifier.weight)
