"""Hugging Face hub ids as inputs: resolved through the client's own cache and offline behaviour, never a mock.

The cache is laid out on disk as ``huggingface_hub`` writes it (:mod:`hub_cache`; checked against a real
download below) from tiny models saved by transformers; the download path runs the real client against a local
stand-in for the hub's HTTP API (:mod:`hub_server`), which records every file the client asks for.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from huggingface_hub import ModelCard
from safetensors.torch import load_file

from hub_cache import add_commit, folder_files, git_blob_sha1, repo_folder, snapshot
from hub_server import FakeHub
from specmerge import merge
from specmerge.cli import main
from specmerge.io.formats.sources import open_source
from specmerge.io.hub.ids import HubError, announce_inputs, hub_cache, hub_offline, parse_hub_id, resolve_input
from specmerge.io.hub.snapshot import needed_files
from tiny_models import build_family


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """A tiny Llama base and two experts saved by transformers."""
    return build_family(tmp_path_factory.mktemp("models"), "llama", n_experts=2)


@pytest.fixture(scope="module")
def cache(family, tmp_path_factory):
    """A hub cache: org/base (main), org/math at two commits (tag v1: expert 0; main: expert 1)."""
    base, experts = family
    root = tmp_path_factory.mktemp("hub") / "hub"
    commits = {
        "base": add_commit(root, "org/base", folder_files(base), tree=True),
        "v1": add_commit(root, "org/math", folder_files(experts[0]), refs=("v1",), no_exist=("adapter_config.json",)),
        "main": add_commit(root, "org/math", folder_files(experts[1]), refs=("main",)),
    }
    return root, commits


@pytest.fixture
def offline(cache, monkeypatch, tmp_path):
    """HF_HUB_OFFLINE=1 with HF_HUB_CACHE at the test cache (read when an id is resolved, not at import)."""
    root, commits = cache
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no token file or other state of this machine
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    return root, commits


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def cli(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specmerge", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_cli_merges_hub_ids_offline_bit_for_bit_as_the_local_folders(family, cache, tmp_path):
    base, experts = family
    root, commits = cache
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "HF_HUB_CACHE": str(root), "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    env.pop("HF_ENDPOINT", None)
    args = ["merge", "org/base", "org/math@v1", "org/math", "-o", "out", "--threads", "1", "--no-fsync"]
    done = cli(args, work, env)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("specmerge: ")]
    assert sum(line.startswith("specmerge: not merged with swudi_a: ") for line in lines) == 1  # the plan's account
    lines = [line for line in lines if not line.startswith("specmerge: not merged with")]
    cached = ", from the cache only (HF_HUB_OFFLINE is set) -> "
    said = [("org/base", "org/base", "base"), ("org/math@v1", "org/math", "v1"), ("org/math", "org/math", "main")]
    assert lines == [
        f"specmerge: {spec}: Hugging Face hub commit {commits[c][:12]}{cached}" + str(snapshot(root, repo, commits[c]))
        for spec, repo, c in said
    ]
    merge(base, experts, tmp_path / "local", threads=1, progress=False, fsync=False)
    assert_same_weights(work / "out", tmp_path / "local")
    assert (work / "out" / "config.json").read_bytes() == (tmp_path / "local" / "config.json").read_bytes()
    # what is written names the hub ids pinned to the commits read, and reruns offline from anywhere
    recipe = yaml.safe_load((work / "out" / "recipe.yaml").read_text())
    assert recipe["base"] == f"org/base@{commits['base']}"
    assert recipe["experts"] == [f"org/math@{commits['v1']}", f"org/math@{commits['main']}"]
    card = ModelCard.load(work / "out" / "README.md").data
    assert (card.base_model, card.library_name) == (["org/base", "org/math"], "transformers")  # ids, no revision
    report = json.loads((work / "out" / "report.json").read_text())
    assert [(i["origin"], i["revision"], i["commit"]) for i in report["inputs"]] == [
        ("hub", None, commits["base"]), ("hub", "v1", commits["v1"]), ("hub", None, commits["main"])
    ]  # fmt: skip
    again = cli(["run", str(work / "out" / "recipe.yaml"), "-o", "again", "--threads", "1", "-q"], tmp_path, env)
    assert again.returncode == 0, again.stderr
    assert "specmerge: org/" not in again.stderr  # -q: no resolution lines
    assert_same_weights(tmp_path / "again", tmp_path / "local")


@pytest.mark.parametrize("revision", [None, "main", "v1", "commit", "short"])
def test_branch_tag_and_commit_revisions_resolve_to_their_snapshot(offline, revision):
    root, commits = offline
    asked = {"commit": commits["v1"], "short": commits["v1"][:7]}.get(revision, revision)
    resolved = resolve_input("org/math" + (f"@{asked}" if asked else ""))
    commit = commits["main"] if revision in (None, "main") else commits["v1"]
    assert (resolved.origin, resolved.repo_id, resolved.revision, resolved.commit) == ("hub", "org/math", asked, commit)
    assert resolved.path == snapshot(root, "org/math", commit)
    blobs = repo_folder(root, "org/math") / "blobs"
    with open_source(resolved.path) as source:  # read through the snapshot's links, inside the repo's blobs/
        assert [f.parent for f in source.files()] == [blobs]


def test_a_missing_id_is_one_line_with_the_id_the_cache_and_how_to_download(offline, tmp_path, capsys):
    root, _ = offline
    assert main(["merge", "org/base", "org/nope@v2", "-o", str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specmerge: error: Hugging Face hub id org/nope at revision 'v2'")
    assert f"is not in the cache {root} and HF_HUB_OFFLINE is set" in err
    assert "`hf download org/nope --revision v2`" in err and "unset HF_HUB_OFFLINE" in err
    assert not (tmp_path / "out").exists()
    with pytest.raises(HubError, match=r"org/math at revision 'v9' is not in the cache .*--revision v9"):
        resolve_input("org/math@v9")


def test_an_unreachable_hub_falls_back_to_the_cache_and_says_so(offline, monkeypatch, capsys):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    with socket.socket() as s:  # a port nothing listens on: the client's connection is refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with announce_inputs(True):
        resolved = resolve_input("org/math@v1")
    assert resolved.offline_reason == "the hub could not be reached (ConnectError)"
    assert "from the cache only (the hub could not be reached (ConnectError))" in capsys.readouterr().err
    with pytest.raises(HubError, match=r"org/nope is not in the cache .* the hub could not be reached .*network"):
        resolve_input("org/nope")


@pytest.mark.parametrize(
    ("name", "target"),
    [
        ("model.safetensors", "another repository's blob"),
        ("model.safetensors", "/etc/passwd"),
        ("config.json", "/etc/hostname"),
        ("tokenizer.json", "/etc/passwd"),
        ("README.md", "/etc/passwd"),
        ("model.safetensors.index.json", "/etc/passwd"),
        ("adapter_config.json", "another repository's blob"),  # read as an expert: an adapter's config
    ],
)
def test_cache_links_out_of_the_repositorys_blobs_are_refused(family, tmp_path, monkeypatch, capsys, name, target):
    base, experts = family
    root = tmp_path / "hub"
    add_commit(root, "org/base", folder_files(base))
    link = snapshot(root, "org/evil", add_commit(root, "org/evil", folder_files(experts[0]))) / name
    if target == "another repository's blob":
        target = os.path.relpath(next((repo_folder(root, "org/base") / "blobs").iterdir()), link.parent)
    if os.path.lexists(link):
        link.unlink()
    link.symlink_to(target)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    inputs = ["org/base", "org/evil"] if name == "adapter_config.json" else ["org/evil", "org/base"]
    assert main(["merge", *inputs, "-o", str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"{name} is a symbolic link to {target}" in err and "outside" in err, err
    assert "models--org--evil/snapshots" in err
    assert not (tmp_path / "out").exists()


def test_a_snapshot_folder_that_is_a_link_is_refused(family, tmp_path, monkeypatch):
    _, experts = family
    root = tmp_path / "hub"
    commit = add_commit(root, "org/linked", folder_files(experts[0]))
    folder = snapshot(root, "org/linked", commit)
    shutil.rmtree(folder)
    folder.symlink_to(experts[0])  # the snapshot "is" a folder elsewhere: its files would all be "inside" it
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match=rf"snapshot {folder} is a symbolic link to {experts[0]}, not a folder of"):
        resolve_input("org/linked")


def test_a_local_folder_named_like_the_id_wins_and_the_line_says_so(family, offline, tmp_path, monkeypatch, capsys):
    base, experts = family
    work = tmp_path / "work"
    shutil.copytree(experts[0], work / "org" / "math")  # the cache's org/math (main) is expert 1
    monkeypatch.chdir(work)
    assert main(["merge", "org/base", "org/math", "-o", "out", "--threads", "1", "-m", "task_arithmetic"]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("specmerge: org/")]
    assert lines[0] == (  # said when the path is made absolute, before the ids are resolved
        f"specmerge: org/math: the local folder {work / 'org' / 'math'}, not the Hugging Face hub id of that name "
        "(a local path wins; run from another folder to use the hub's)"
    )
    assert len(lines) == 2 and lines[1].startswith("specmerge: org/base: Hugging Face hub commit")
    report = json.loads((work / "out" / "report.json").read_text())
    assert [i["origin"] for i in report["inputs"]] == ["hub", "local"]
    assert yaml.safe_load((work / "out" / "recipe.yaml").read_text())["experts"] == ["../org/math"]
    card = ModelCard.load(work / "out" / "README.md")  # base_model names hub repositories only; the path: the text
    assert (card.data.base_model, card.data.base_model_relation) == (["org/base"], "merge")
    assert "left out of `base_model`, which names hub repositories: `../org/math`." in card.text
    merge(base, experts[:1], tmp_path / "local", method="task_arithmetic", threads=1, progress=False)
    assert_same_weights(work / "out", tmp_path / "local")


def test_a_bare_local_folder_is_named_only_when_the_cache_holds_that_id_or_with_verbose(
    family, offline, tmp_path, monkeypatch, capsys
):
    """``llama-base`` is a folder here and has a hub id's shape: a line saying the folder wins is noise unless the
    hub cache holds a repository of that name (which may have been meant), or with -v."""
    base, experts = family
    monkeypatch.chdir(base.parent)
    outputs = iter(range(10))
    args = ["merge", base.name, experts[0].name, "-m", "task_arithmetic", "--threads", "1", "--no-fsync"]

    def said(*extra: str) -> list[str]:
        assert main([*args, "-o", str(tmp_path / f"out{next(outputs)}"), *extra]) == 0
        return [line for line in capsys.readouterr().err.splitlines() if "the local folder" in line]

    assert said() == []  # neither name is in the cache
    line = "specmerge: {}: the local folder {}, not the Hugging Face hub id of that name (a local path wins; run from "
    expected = [line.format(p.name, p) + "another folder to use the hub's)" for p in (base, experts[0])]
    assert said("-v") == said("--verbose") == expected
    assert said("-q") == []
    add_commit(tmp_path / "hub", base.name, folder_files(base))  # a hub cache holding an id named like the base
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert said() == expected[:1]
    with pytest.raises(SystemExit):  # one or the other
        main([*args, "-o", str(tmp_path / "both"), "-q", "-v"])


def test_a_recipe_keeps_an_id_unless_its_folder_holds_that_name(offline, tmp_path):
    from specmerge.pipeline.recipe.model import load_recipe

    folder = tmp_path / "recipes"
    folder.mkdir()
    (folder / "r.yaml").write_text("base: org/base\nexperts: [org/math@v1, org/code]\n")
    assert load_recipe(folder / "r.yaml").experts == ["org/math@v1", "org/code"]
    (folder / "org" / "code").mkdir(parents=True)
    recipe = load_recipe(folder / "r.yaml")
    assert (recipe.base, recipe.experts) == ("org/base", ["org/math@v1", str(folder / "org" / "code")])


def test_a_recipe_run_from_its_parent_folder_says_nothing_of_ids_for_dotted_paths(
    offline, tmp_path, monkeypatch, caplog
):
    """``./org/code`` in a recipe read as ``r.yaml`` from its own folder is a path, never an id: no notice."""
    from specmerge.pipeline.recipe.model import load_recipe

    (tmp_path / "org" / "code").mkdir(parents=True)
    (tmp_path / "r.yaml").write_text("base: ./org/code\nexperts: [org/code]\n")
    monkeypatch.chdir(tmp_path)
    with caplog.at_level("DEBUG", logger="specmerge.inputs"):  # DEBUG: org/code is not in the cache
        recipe = load_recipe("r.yaml")
    assert recipe.base == str(tmp_path / "org" / "code")
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["org/code"]  # only the id-shaped spec


def test_only_the_files_a_merge_reads_are_asked_for():
    listing = [
        ".gitattributes", "README.md", "config.json", "generation_config.json", "model.safetensors.index.json",
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "consolidated.safetensors",
        "pytorch_model.bin.index.json", "pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin",
        "training_args.bin", "tf_model.h5", "flax_model.msgpack", "onnx/model.onnx", "original/consolidated.00.pth",
        "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "modeling_x.py",
    ]  # fmt: skip
    assert needed_files(listing) == [
        "model.safetensors.index.json",
        "README.md",
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "modeling_x.py",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]  # fmt: skip  (the shards come from the index once it is read)
    assert needed_files(["pytorch_model.bin", "config.json", "training_args.bin"]) == [
        "pytorch_model.bin",
        "config.json",
    ]
    adapter = ["adapter_config.json", "adapter_model.safetensors", "adapter_model.bin", "README.md", "optimizer.pt"]
    assert needed_files(adapter) == ["adapter_config.json", "adapter_model.safetensors", "README.md"]


def test_a_repo_with_bin_and_safetensors_reads_only_the_safetensors(family, tmp_path, monkeypatch):
    base, experts = family
    root = tmp_path / "hub"
    files = folder_files(experts[0])
    unread = {"pytorch_model.bin": b"not a checkpoint", "training_args.bin": b"\x80\x04 not a pickle"}
    # as a specmerge download leaves it: the tree listing has every file, the snapshot only what was asked for
    commit = add_commit(root, "org/both", files, listed_only=unread)
    add_commit(root, "org/base", folder_files(base))
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    resolved = resolve_input("org/both")  # the client checks the snapshot against the listing, for what is asked
    assert resolved.path == snapshot(root, "org/both", commit)
    # the same with the .bin files cached too (garbage: reading them would fail): they are not read
    add_commit(root, "org/both", {**files, **unread})
    report = merge("org/base", ["org/both"], tmp_path / "out", method="task_arithmetic", progress=False)
    assert report["inputs"][1]["commit"] == commit
    assert (snapshot(root, "org/both", commit) / "pytorch_model.bin").is_file()
    with open_source(resolve_input("org/both").path) as source:  # its one real file: the safetensors blob
        assert [f.name for f in source.files()] == [hashlib.sha256(files["model.safetensors"]).hexdigest()]


def test_a_snapshot_missing_a_file_the_listing_has_is_one_line(family, tmp_path, monkeypatch):
    base, _ = family
    root = tmp_path / "hub"
    files = folder_files(base)
    add_commit(
        root,
        "org/partial",
        {k: v for k, v in files.items() if k != "config.json"},
        listed_only={"config.json": files["config.json"]},
    )
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        HubError,
        match=r"org/partial: the cached snapshot .* lacks 1 file\(s\) a merge reads \(config\.json\), and HF_HUB_OFF"
        r"LINE is set: download them with `hf download org/partial`",
    ):
        resolve_input("org/partial")


@pytest.mark.parametrize("listed", [False, True])
def test_a_cached_snapshot_without_weights_names_the_id_and_how_to_download_it(family, tmp_path, monkeypatch, listed):
    """Downloaded without its weights (e.g. ``hf download org/x config.json``), a snapshot is no checkpoint: the line
    names the id and revision and the download command, not only the snapshot folder; a repository whose cached
    listing has no weights either is said to hold none."""
    base, _ = family
    root = tmp_path / "hub"
    commit = add_commit(root, "org/configs", {"config.json": folder_files(base)["config.json"]}, refs=("main", "v1"),
                        tree=listed)  # fmt: skip
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for revision in (None, "v1"):
        with pytest.raises(HubError) as raised:
            resolve_input("org/configs" + (f"@{revision}" if revision else ""))
        shown = "org/configs" + (f" at revision '{revision}'" if revision else "")
        if listed:
            assert str(raised.value).startswith(f"Hugging Face hub id {shown}: the repository holds no checkpoint at "
                                                f"commit {commit} (no *.safetensors, *.bin")  # fmt: skip
        else:
            download = "`hf download org/configs" + (f" --revision {revision}`" if revision else "`")
            assert str(raised.value) == (
                f"Hugging Face hub id {shown}: the cached snapshot {snapshot(root, 'org/configs', commit)} holds no "
                f"checkpoint (its weights were not downloaded), and HF_HUB_OFFLINE is set: download it with {download}"
                ", or unset HF_HUB_OFFLINE"
            )


def test_the_environment_is_read_when_an_id_is_resolved(monkeypatch, tmp_path):
    for name in (
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "HF_HOME",
        "XDG_CACHE_HOME",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
    ):
        monkeypatch.delenv(name, raising=False)
    assert hub_cache() == Path.home() / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hub_cache() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    assert hub_cache() == tmp_path / "cache"
    assert not hub_offline()
    for value, offline in (("1", True), ("true", True), ("ON", True), ("yes", True), ("0", False), ("", False)):
        monkeypatch.setenv("HF_HUB_OFFLINE", value)
        assert hub_offline() is offline, value


@pytest.mark.parametrize(
    ("spec", "parsed"),
    [
        ("gpt2", ("gpt2", None)),
        ("meta-llama/Llama-3.2-3B", ("meta-llama/Llama-3.2-3B", None)),
        ("org/code-expert@a1b2c3d", ("org/code-expert", "a1b2c3d")),
        ("org/name@refs/pr/1", ("org/name", "refs/pr/1")),
        ("org/name@v1.0", ("org/name", "v1.0")),
        ("./org/name", None),
        ("/abs/org", None),
        ("~/models/x", None),
        ("a/b/c", None),
        ("model.safetensors", None),
        ("org/model.bin", None),
        ("org/na--me", None),
        ("org/-name", None),
        ("org/name@", None),
        ("org/name@a b", None),
        ("org/name@../x", None),
        ("", None),
    ],
)
def test_which_specs_are_hub_ids(spec, parsed):
    assert parse_hub_id(spec) == parsed


def test_inspect_takes_hub_ids(offline, tmp_path, capsys):
    args = ["inspect", "org/base", "org/math@v1", "org/math", "--out", str(tmp_path / "report"), "--no-wudi"]
    assert main([*args, "--no-plots", "-q", "--threads", "1"]) == 0
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["layers_inspected"] > 0


def test_a_lora_output_of_a_hub_base_names_the_id_and_commit(family, offline, tmp_path):
    from tiny_models import save_adapter

    base, _ = family
    root, commits = offline
    for i, name in enumerate(["org/lora-a", "org/lora-b"]):
        folder = save_adapter(base, tmp_path / name.split("/")[1], seed=i, r=2, target_modules=["q_proj", "v_proj"])
        add_commit(root, name, folder_files(folder))
    out = tmp_path / "adapter"
    merge("org/base", ["org/lora-a", "org/lora-b"], out, method="task_arithmetic", output_format="lora", progress=False)
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["revision"]) == ("org/base", commits["base"])
    card = ModelCard.load(out / "README.md").data
    assert (card.base_model, card.base_model_relation) == (["org/base"], "adapter")


def test_downloads_fetch_only_the_needed_files_through_the_real_client(family, tmp_path, monkeypatch):
    base, experts = family
    extra = {"pytorch_model.bin": b"x", "training_args.bin": b"y", "onnx/model.onnx": b"z", ".gitattributes": b"*"}
    readme = b"---\nlicense: apache-2.0\n---\n# base\n"
    root = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with FakeHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        c0 = hub.add("org/base", {**folder_files(base), **extra, "README.md": readme})
        c1 = hub.add("org/math", folder_files(experts[0]), refs=("v1",))
        c2 = hub.add("org/math", folder_files(experts[1]))
        hub.add("org/gated", folder_files(base))
        hub.gated.add("org/gated")
        report = merge("org/base", ["org/math@v1", "org/math"], tmp_path / "out", threads=1, progress=False)
        wanted = ["config.json", "generation_config.json", "model.safetensors"]
        asked = {
            f"org/{repo}/{f}" for repo, files in (("base", [*wanted, "README.md"]), ("math", wanted)) for f in files
        }
        assert set(hub.files_requested("GET") + hub.files_requested("HEAD")) == asked  # never the .bin, .onnx, ...
        with pytest.raises(HubError, match=r"org/gated is a gated repository: accept its conditions on "):
            resolve_input("org/gated")
        with pytest.raises(HubError, match=r"org/nope: no such model repository on the hub"):
            resolve_input("org/nope")
        gone = add_commit(root, "org/gone", folder_files(base))  # cached, but the hub no longer serves it
        assert (resolve_input("org/gone").commit, resolve_input("org/gone").offline_reason) == (
            gone,
            "the hub answered 404",
        )
        with pytest.raises(HubError, match=r"org/math has no revision 'v9' \(a branch, tag or commit\)"):
            resolve_input("org/math@v9")
    assert [i["commit"] for i in report["inputs"]] == [c0, c1, c2]
    assert "license: apache-2.0" in (tmp_path / "out" / "README.md").read_text()
    merge(base, experts, tmp_path / "local", threads=1, progress=False)
    assert_same_weights(tmp_path / "out", tmp_path / "local")
    # the client's cache is what tests/hub_cache.py lays out, and works offline by branch and tag afterwards
    laid = tmp_path / "laid"
    add_commit(laid, "org/math", folder_files(experts[0]), refs=("v1",), tree=True)
    add_commit(laid, "org/math", folder_files(experts[1]), tree=True)
    assert _layout(root / "models--org--math") == _layout(laid / "models--org--math")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_input("org/math@v1").commit == c1 and resolve_input("org/math").commit == c2


def _layout(repo: Path) -> dict[str, str]:
    """Every entry of a cache repository folder (trees/ left out: listings differ in what the hub reported):
    link targets, file contents' hashes, folders."""
    found = {}
    for path in sorted(repo.rglob("*")):
        rel = path.relative_to(repo).as_posix()
        if rel.startswith("trees"):
            continue
        found[rel] = (
            os.readlink(path) if path.is_symlink() else "dir" if path.is_dir() else git_blob_sha1(path.read_bytes())
        )
    return found


def test_two_specs_of_one_snapshot_are_one_expert(offline, tmp_path):
    from specmerge.errors import RecipeError

    with pytest.raises(RecipeError, match=r"experts 'org/math' and 'org/math@main' are the same checkpoint"):
        merge("org/base", ["org/math", "org/math@main"], tmp_path / "out", progress=False)
    with pytest.raises(RecipeError, match=r"expert 'org/base@main' is the base model 'org/base'"):
        merge("org/base", ["org/base@main"], tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_corrupt_ref_in_the_cache_is_named_as_such(offline, tmp_path, capsys):
    """A garbled refs/main used to be blamed on the revision ("has no revision 'main'")."""
    root, _ = offline
    ref = root / "models--org--math" / "refs" / "main"
    ref.write_text("not a commit\n")
    assert main(["merge", "org/base", "org/math", "-o", str(tmp_path / "out"), "-q"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"the cache's {ref} holds 'not a commit', not a commit hash" in err, err
    assert "hf download org/math" in err and not (tmp_path / "out").exists()
