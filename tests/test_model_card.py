"""The model card and recipe written into a merged folder: the hub's front matter, portable input names.

A folder meant to be published names its inputs as hub ids (tests/test_hub.py) or by paths relative to itself,
never by the user's absolute paths, and its recipe reruns from any working folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from huggingface_hub import ModelCard
from safetensors.torch import load_file

from specmerge import merge
from specmerge.cli import main
from specmerge.io.output.readme import read_license
from tiny_models import build_family, save_adapter


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A project folder holding a tiny Llama base (with a model card stating its license) and two experts."""
    root = tmp_path_factory.mktemp("project")
    base, experts = build_family(root / "models", "llama", n_experts=2)
    (base / "README.md").write_text("---\nlicense: apache-2.0\nlanguage: en\n---\n# A tiny Llama\n")
    return root, base, experts


def front_matter(folder: Path) -> dict:
    """The card's metadata as huggingface_hub parses it."""
    return ModelCard.load(folder / "README.md").data.to_dict()


def test_the_card_has_the_hubs_front_matter_and_relative_paths(models):
    root, base, experts = models
    out = root / "merged"
    merge(base, experts, out, progress=False)
    assert front_matter(out) == {  # no base_model: it names hub repositories, and every input here is local
        "library_name": "transformers",
        "tags": ["merge", "specmerge", "swudi_a"],
        "license": "apache-2.0",
    }
    recipe = yaml.safe_load((out / "recipe.yaml").read_text())
    assert (recipe["base"], recipe["experts"]) == (
        "../models/llama-base",
        ["../models/llama-expert0", "../models/llama-expert1"],
    )
    assert recipe["expert_keys"] == ["llama-expert0", "llama-expert1"]  # stated, so a rerun seeds DARE alike
    card = (out / "README.md").read_text()
    assert (  # the local inputs are named in the text instead
        "relative to this folder and left out of `base_model`, which names hub repositories: `../models/llama-base`, "
        "`../models/llama-expert0`, `../models/llama-expert1`."
    ) in card
    report = json.loads((out / "report.json").read_text())
    assert "host" not in report  # the report is published with the model; the host is only in the work folder's owner
    assert report["license"] == {"license": "apache-2.0"}
    assert [(i["role"], i["name"], i["origin"]) for i in report["inputs"]] == [
        ("base", "../models/llama-base", "local"),
        ("expert", "../models/llama-expert0", "local"),
        ("expert", "../models/llama-expert1", "local"),
    ]
    for name in ("README.md", "recipe.yaml", "report.json"):  # nothing names where the user keeps things
        assert str(root) not in (out / name).read_text(), name


def test_the_written_recipe_reruns_from_another_working_folder(models, tmp_path, monkeypatch):
    root, base, experts = models
    out = root / "for-rerun"
    merge(base, experts, out, method="dare_ties", threads=1, progress=False)  # seeded: the keys matter
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    recipe = os.path.relpath(out / "recipe.yaml")
    assert main(["run", recipe, "-o", "again", "--threads", "1", "-q"]) == 0
    first, second = load_file(out / "model.safetensors"), load_file(elsewhere / "again" / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    rerun = yaml.safe_load((elsewhere / "again" / "recipe.yaml").read_text())
    assert rerun["base"] == os.path.relpath(base, elsewhere / "again")


def test_a_lora_output_names_the_base_it_applies_to(models, tmp_path):
    root, base, _ = models
    adapters = [
        save_adapter(base, root / "adapters" / f"lora{i}", seed=i, r=2, target_modules=["q_proj", "v_proj"])
        for i in range(2)
    ]
    out = root / "merged-lora"
    merge(base, adapters, out, method="task_arithmetic", output_format="lora", progress=False)
    assert front_matter(out) == {  # the base is a local folder: no base_model
        "library_name": "peft",
        "tags": ["merge", "specmerge", "task_arithmetic"],
        "license": "apache-2.0",
    }
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "../models/llama-base" and "revision" not in config
    assert yaml.safe_load((out / "recipe.yaml").read_text())["experts"] == ["../adapters/lora0", "../adapters/lora1"]


@pytest.mark.parametrize(
    ("readme", "config_license", "expected"),
    [
        ("---\nlicense: mit\n---\n", None, {"license": "mit"}),
        ("---\r\nlicense: llama3.2\r\n---\r\ntext", None, {"license": "llama3.2"}),
        (
            "---\nlicense: other\nlicense_name: my-license\nlicense_link: https://example.org/LICENSE\n---\n",
            None,
            {"license": "other", "license_name": "my-license", "license_link": "https://example.org/LICENSE"},
        ),
        ("---\nlicense: other\nlicense_link: LICENSE.md\n---\n", None, {"license": "other"}),  # no local file link
        ("---\nlicense: [mit, apache-2.0]\n---\n", "mit", {"license": "mit"}),  # not one id: the config's
        ("---\nlicense: 'a b: c'\n---\n", None, {}),
        ("---\nlicense: mit\n", None, {}),  # no closing line: no front matter
        ("---\n[unclosed\n---\n", "apache-2.0", {"license": "apache-2.0"}),
        ("# no front matter\n", None, {}),
        (None, "bsd-3-clause", {"license": "bsd-3-clause"}),
        (None, None, {}),
    ],
)
def test_the_license_comes_from_the_readme_else_the_config(tmp_path, readme, config_license, expected):
    if readme is not None:
        (tmp_path / "README.md").write_text(readme)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "license": config_license}))
    assert read_license(tmp_path) == expected
    assert read_license(tmp_path / "config.json") == {}  # a single file has no card


def test_a_readme_linked_out_of_the_base_folder_is_refused_before_any_work(models, tmp_path, capsys):
    _, base, experts = models
    copy = tmp_path / "base"
    copy.mkdir()
    for f in base.iterdir():
        if f.name != "README.md":
            (copy / f.name).write_bytes(f.read_bytes())
    (copy / "README.md").symlink_to("/etc/passwd")
    assert main(["merge", str(copy), *map(str, experts), "-o", str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "README.md is a symbolic link to /etc/passwd" in err and "outside" in err
    assert not (tmp_path / "out").exists()
