"""Hostile and messy inputs (issue 13, items 1-4, 11, 14, 15): nothing outside a model folder is read or copied,
no pickle runs, no input is deleted or merged twice, and every problem is one line naming the path."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specmerge.cli import main
from specmerge.errors import RecipeError, SpecmergeError
from specmerge.io.formats.peft import open_adapter
from specmerge.io.formats.protocol import SourceError
from specmerge.io.formats.sources import open_source
from specmerge.io.output.model_files import copy_model_files
from specmerge.pipeline.inputs.open import refuse_output_inside_inputs
from specmerge.pipeline.run.api import merge

FAST = {"method": "task_arithmetic", "progress": False, "fsync": False}


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"layer.weight": torch.randn(4, 3, generator=g), "layer.bias": torch.randn(4, generator=g)}


def model(folder: Path, seed: int, name: str = "model.safetensors") -> Path:
    """A tiny model folder: one safetensors file of two tensors."""
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights(seed), folder / name)
    return folder


def family(root: Path, n: int = 2) -> tuple[Path, list[Path]]:
    base = model(root / "base", 0)
    (base / "config.json").write_text('{"model_type": "tiny"}')
    return base, [model(root / f"expert{i}", i + 1) for i in range(n)]


def secret(root: Path) -> Path:
    """A private file outside every model folder, as ~/.ssh/id_rsa would be."""
    (root / "home").mkdir(exist_ok=True)
    path = root / "home" / "id_rsa"
    path.write_text("-----BEGIN PRIVATE KEY-----\n")
    path.chmod(0o600)
    return path


def cli_error(argv: list[str], capsys) -> str:
    """Run the CLI, expect exit 2 and return its one-line error."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("specmerge: error: ") and err.count("\n") == 1, err
    return err


def one_line(err: pytest.ExceptionInfo) -> str:
    message = str(err.value)
    assert "\n" not in message, message
    return message


def hf_repo(cache: Path, name: str, files: dict[str, bytes], revision: str = "abc123") -> Path:
    """A Hugging Face cache repository: blobs/<sha> holds the bytes, snapshots/<rev>/<name> links to it."""
    repo = cache / f"models--org--{name}"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for i, (file, data) in enumerate(files.items()):
        blob = f"{name}{i:04d}" + "0" * 32
        (repo / "blobs" / blob).write_bytes(data)
        (snapshot / file).symlink_to(Path("..", "..", "blobs", blob))
    return snapshot


def safetensors_bytes(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> bytes:
    save_file(tensors, tmp_path / "scratch.safetensors")
    data = (tmp_path / "scratch.safetensors").read_bytes()
    (tmp_path / "scratch.safetensors").unlink()
    return data


# 1. Model files are copied only from inside the base folder, as plain 0644 files.


@pytest.mark.parametrize("how", ["absolute", "relative", "chain"])
def test_copy_refuses_a_link_out_of_the_base_folder(tmp_path, capsys, how):
    base, experts = family(tmp_path)
    key = secret(tmp_path)
    if how == "absolute":
        (base / "tokenizer.model").symlink_to(key)
    elif how == "relative":
        (base / "tokenizer.model").symlink_to(Path("..", "home", "id_rsa"))
    else:  # a link to a link inside the folder, which leads out
        (base / "inner").symlink_to(key)
        (base / "tokenizer.model").symlink_to("inner")
    out = tmp_path / "out"
    err = cli_error(["merge", str(base), *map(str, experts), "-o", str(out), "-q", "-m", "task_arithmetic"], capsys)
    assert f"{base / 'tokenizer.model'} is a symbolic link to" in err and str(key) in err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["base", "expert0", "expert1", "home"]

    (tmp_path / "copy").mkdir()
    with pytest.raises(SourceError, match=r"tokenizer\.model is a symbolic link to .*outside"):
        copy_model_files(base, tmp_path / "copy")
    assert list((tmp_path / "copy").iterdir()) == []


def test_copy_follows_links_into_the_same_hf_cache_repo_only(tmp_path):
    cache = tmp_path / "hub"
    files = {"config.json": b'{"model_type": "tiny"}', "tokenizer.json": b"{}"}
    base = hf_repo(cache, "base", {**files, "model.safetensors": safetensors_bytes(tmp_path, weights(0))})
    expert = hf_repo(cache, "expert", {"model.safetensors": safetensors_bytes(tmp_path, weights(1))})
    merge(base, [expert], tmp_path / "out", **FAST)
    for name in ("config.json", "tokenizer.json"):  # copied as files, not links
        assert not (tmp_path / "out" / name).is_symlink()
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == b"{}"

    # A blob of another repository of the cache is outside this one.
    other = next((cache / "models--org--expert" / "blobs").iterdir())
    (base / "vocab.json").symlink_to(Path("..", "..", "..", "models--org--expert", "blobs", other.name))
    with pytest.raises(SourceError, match=r"vocab\.json is a symbolic link to .*models--org--expert.*outside"):
        merge(base, [expert], tmp_path / "out2", **FAST)
    assert not (tmp_path / "out2").exists()

    # A repository whose blobs/ is itself a link (here to the user's home) is no cache.
    key = secret(tmp_path)
    fake = tmp_path / "fake" / "models--org--fake"
    (fake / "snapshots" / "r").mkdir(parents=True)
    (fake / "blobs").symlink_to(key.parent)
    shutil.copy(base / "model.safetensors", fake / "snapshots" / "r" / "model.safetensors")
    (fake / "snapshots" / "r" / "tokenizer.model").symlink_to(Path("..", "..", "blobs", "id_rsa"))
    (tmp_path / "copy").mkdir()
    with pytest.raises(SourceError, match=r"tokenizer\.model is a symbolic link to \.\./\.\./blobs/id_rsa"):
        copy_model_files(fake / "snapshots" / "r", tmp_path / "copy")


def test_copies_are_plain_files_never_more_open_than_0644(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    for name, mode in (("config.json", 0o4777), ("configuration_custom.py", 0o755), ("vocab.json", 0o600)):
        (base / name).write_text(name)
        (base / name).chmod(mode)
    (tmp_path / "out").mkdir()
    old = os.umask(0)
    try:
        copied = copy_model_files(base, tmp_path / "out")
    finally:
        os.umask(old)
    assert copied == ["config.json", "configuration_custom.py", "vocab.json"]
    for name in copied:
        assert stat.S_IMODE((tmp_path / "out" / name).stat().st_mode) == 0o644, name
        assert (tmp_path / "out" / name).read_text() == name


# 2. Every file a source opens from a folder lies inside it (or in its cache repository's blobs/).


@pytest.mark.parametrize("shard", ["../elsewhere/x.safetensors", "ABSOLUTE", "sub/x.safetensors", "..", ""])
def test_index_shard_names_are_plain_file_names(tmp_path, shard):
    model(tmp_path / "elsewhere", 5, "x.safetensors")
    model(tmp_path / "folder" / "sub", 5, "x.safetensors")
    if shard == "ABSOLUTE":
        shard = str(tmp_path / "elsewhere" / "x.safetensors")
    index = {"weight_map": {"layer.weight": shard, "layer.bias": shard}}
    (tmp_path / "folder" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        SourceError, match=r"model\.safetensors\.index\.json: shard '.*' \(holding 'layer\.weight'\) is not a plain"
    ):
        open_source(tmp_path / "folder").infos()


def adapter_folder(folder: Path) -> Path:
    folder.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["layer"], "task_type": None}
    config.update(use_rslora=False, fan_in_fan_out=False)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(3)
    factors = {"base_model.model.layer.lora_A.weight": torch.randn(2, 3, generator=g)}
    factors["base_model.model.layer.lora_B.weight"] = torch.randn(4, 2, generator=g)
    save_file(factors, folder / "adapter_model.safetensors")
    return folder


@pytest.mark.parametrize(
    "name",
    ["model.safetensors", "pytorch_model.bin", "model-00001-of-00001.safetensors", "only.safetensors", "index"],
)
def test_weights_linked_out_of_a_model_folder_are_refused(tmp_path, name):
    folder = tmp_path / "expert"
    folder.mkdir()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    if name == "pytorch_model.bin":
        torch.save(weights(1), outside / "w.bin")
        target = outside / "w.bin"
    else:
        target = model(outside, 1, "w.safetensors") / "w.safetensors"
    if name == "index":  # the index itself lives elsewhere
        (outside / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"layer.weight": "x.safetensors", "layer.bias": "x.safetensors"}})
        )
        model(folder, 1, "x.safetensors")
        name, target = "model.safetensors.index.json", outside / "model.safetensors.index.json"
    elif name.startswith("model-"):
        index = {"weight_map": {"layer.weight": name, "layer.bias": name}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / name).symlink_to(target)
    with pytest.raises(SourceError) as err:
        open_source(folder).infos()
    message = one_line(err)
    assert f"{name} (holding 'layer.weight')" in message or f"{folder / name} " in message
    assert f"is a symbolic link to {target}, outside {folder}" in message


@pytest.mark.parametrize("name", ["adapter_config.json", "adapter_model.safetensors"])
def test_adapter_files_linked_out_of_the_adapter_folder_are_refused(tmp_path, name):
    folder = adapter_folder(tmp_path / "adapter")
    (tmp_path / "elsewhere").mkdir()
    (folder / name).rename(tmp_path / "elsewhere" / name)
    (folder / name).symlink_to(tmp_path / "elsewhere" / name)
    with pytest.raises(SourceError, match=rf"{name} is a symbolic link to {tmp_path}/elsewhere/{name}, outside"):
        open_adapter(folder)


def test_hf_snapshot_with_shards_linked_into_blobs_loads(tmp_path):
    shards = {"model-00001-of-00002.safetensors": {"layer.weight": weights(0)["layer.weight"]}}
    shards["model-00002-of-00002.safetensors"] = {"layer.bias": weights(0)["layer.bias"]}
    index = {"weight_map": {n: f for f, tensors in shards.items() for n in tensors}}
    files = {f: safetensors_bytes(tmp_path, t) for f, t in shards.items()}
    snapshot = hf_repo(
        tmp_path / "hub", "sharded", {**files, "model.safetensors.index.json": json.dumps(index).encode()}
    )
    with open_source(snapshot) as source:
        assert torch.equal(source.load("layer.bias"), weights(0)["layer.bias"])
        blobs = tmp_path / "hub" / "models--org--sharded" / "blobs"
        assert len(source.files()) == 3 and all(f.parent == blobs for f in source.files())
    with open_source(snapshot / "model.safetensors.index.json") as source:  # the index given directly
        assert torch.equal(source.load("layer.weight"), weights(0)["layer.weight"])


# 3. A pickle that refers to code is refused unloaded, with no advice to load it unsafely.

MARKER = "specmerge-pickle-ran"


class NotATensor:
    pass


class RunsSystem:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class RunsEval:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return eval, (f"open({str(self.marker)!r}, 'w')",)


class RunsPopen:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return subprocess.Popen, (["touch", str(self.marker)],)


@pytest.mark.parametrize("legacy", [False, True])
@pytest.mark.parametrize(
    ("payload", "named"),
    [(RunsSystem, f"{os.name}.system"), (RunsEval, "eval"), (RunsPopen, "Popen"), (None, "NotATensor")],
)
def test_malicious_pickles_are_refused_unrun_and_without_unsafe_advice(tmp_path, payload, named, legacy):
    marker = tmp_path / MARKER
    value = NotATensor() if payload is None else payload(marker)
    torch.save({"w": torch.ones(2), "evil": value}, tmp_path / "x.bin", _use_new_zipfile_serialization=not legacy)
    with pytest.raises(SourceError) as err:
        open_source(tmp_path / "x.bin").infos()
    message = one_line(err)
    # The global as the pickle names it (protocol 2 writes subprocess.Popen as commands.Popen).
    assert re.search(
        rf"x\.bin: holds code or objects that are not tensors \(its pickle calls or builds [\w.]*{named}\)", message
    )
    assert "was not loaded" in message and "convert it to safetensors" in message
    for unsafe in ("weights_only", "Re-running", "will likely succeed", "corrupt"):
        assert unsafe not in message
    assert not marker.exists()


# 4. --overwrite never deletes a file an input reads.


def test_overwrite_never_replaces_a_file_an_expert_reads_through_a_link(tmp_path, capsys):
    base, experts = family(tmp_path)
    out = tmp_path / "out"
    merge(base, experts, out, **FAST)
    before = (out / "model.safetensors").read_bytes()
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "model.safetensors").symlink_to(out / "model.safetensors")
    for expert in (linked, tmp_path / "file-link.safetensors"):
        if expert.name.endswith(".safetensors"):
            expert.symlink_to(out / "model.safetensors")
        argv = ["merge", str(base), str(experts[0]), str(expert), "-o", str(out), "--overwrite", "-q"]
        err = cli_error([*argv, "-m", "task_arithmetic", "--no-fsync"], capsys)
        assert str(out) in err  # a link from the folder is outside it; a file link overlaps the output
        assert (out / "model.safetensors").read_bytes() == before


def test_output_check_compares_the_real_files_sources_read(tmp_path):
    cache = tmp_path / "hub"
    snapshot = hf_repo(cache, "m", {"model.safetensors": safetensors_bytes(tmp_path, weights(0))})
    blobs = cache / "models--org--m" / "blobs"
    with open_source(snapshot) as source:
        refuse_output_inside_inputs(tmp_path / "out", [str(snapshot)], [source])  # elsewhere: fine
        with pytest.raises(
            SpecmergeError, match=rf"output '{blobs}' holds {blobs}/m0000.*which the input '{snapshot}'"
        ):
            refuse_output_inside_inputs(blobs, [str(snapshot)], [source])


# 11. The same checkpoint twice, or the base as an expert, is refused by the files actually read.


@pytest.mark.parametrize("how", ["folder-link", "own-file", "hard-link", "index-file", "base", "base-link"])
def test_the_same_checkpoint_twice_is_refused(tmp_path, how):
    base, experts = family(tmp_path)
    first = experts[0]
    if how == "folder-link":
        (tmp_path / "again").symlink_to(first)
        second = tmp_path / "again"
    elif how == "own-file":
        second = first / "model.safetensors"
    elif how == "hard-link":
        (tmp_path / "copy").mkdir()
        os.link(first / "model.safetensors", tmp_path / "copy" / "model.safetensors")
        second = tmp_path / "copy"
    elif how == "index-file":
        index = {"weight_map": {"layer.weight": "model.safetensors", "layer.bias": "model.safetensors"}}
        (first / "model.safetensors.index.json").write_text(json.dumps(index))
        second = first / "model.safetensors.index.json"
    elif how == "base":
        first, second = base, base / "model.safetensors"
    else:
        (tmp_path / "base-again").symlink_to(base)
        first, second = base, tmp_path / "base-again"
    listed = [second, experts[1]] if first == base else [first, second]
    with pytest.raises(RecipeError) as err:
        merge(base, listed, tmp_path / "out", **FAST)
    message = one_line(err)
    assert f"'{first}'" in message and f"'{second}'" in message
    assert ("is the base model" if first == base else "are the same checkpoint") in message
    assert not (tmp_path / "out").exists()


# 14. Symbolic link loops and wrong argument types are one-line typed errors.


@pytest.mark.parametrize("where", ["base", "expert"])
def test_a_symbolic_link_loop_is_a_one_line_error(tmp_path, capsys, where):
    base, experts = family(tmp_path)
    loop = tmp_path / "loop"
    loop.symlink_to("loop")
    paths = {"base": base, "expert": experts[1], where: loop}
    argv = ["merge", str(paths["base"]), str(experts[0]), str(paths["expert"]), "-o", str(tmp_path / "out"), "-q"]
    assert f"{loop}: symbolic link loop" in cli_error(argv, capsys)
    with pytest.raises(SourceError, match=r"loop: symbolic link loop"):
        open_source(loop)


def test_api_refuses_a_single_path_for_experts_and_a_string_for_params(tmp_path):
    base, experts = family(tmp_path)
    with pytest.raises(RecipeError, match=r"experts must be a list of paths, got the single path '.*expert0': pass \["):
        merge(base, str(experts[0]), tmp_path / "out", **FAST)
    with pytest.raises(RecipeError, match=r"experts must be a list of paths, got the single path"):
        merge(base, experts[0], tmp_path / "out", **FAST)
    with pytest.raises(RecipeError, match=r"params must be a mapping of parameter names to values.*got str 'scale=2'"):
        merge(base, experts, tmp_path / "out", params="scale=2", **FAST)
    with pytest.raises(RecipeError, match=r"experts\[1\] must be a path"):
        merge(base, [experts[0], 3], tmp_path / "out", **FAST)
    with pytest.raises(RecipeError, match=r"base must be a path"):
        merge(None, experts, tmp_path / "out", **FAST)
    assert not (tmp_path / "out").exists()


# 15. Permission denied, truncation while reading, and shards that are folders or loops are named as such.


@pytest.fixture
def shared_dir():
    """A folder another user may enter (tmp_path's parents are private to the user running the tests)."""
    folder = Path(tempfile.mkdtemp(prefix="specmerge-test-"))
    folder.chmod(0o755)
    yield folder
    for path in folder.rglob("*"):
        with contextlib.suppress(OSError):
            path.chmod(0o755)
    shutil.rmtree(folder)


@contextlib.contextmanager
def unprivileged():
    """Run the block as a user whom mode-000 files deny (root reads everything: it drops to nobody meanwhile)."""
    if os.geteuid() != 0:
        yield
        return
    try:
        os.seteuid(65534)
    except PermissionError:
        pytest.skip("root, and cannot drop privileges here")
    try:
        yield
    finally:
        os.seteuid(0)


@pytest.mark.parametrize("what", ["safetensors", "bin", "folder", "shard", "adapter_config", "index"])
def test_permission_denied_is_not_reported_as_missing_or_corrupt(shared_dir, what):
    folder = model(shared_dir / "m", 0)
    if what == "bin":
        torch.save(weights(0), folder / "pytorch_model.bin")
        (folder / "model.safetensors").unlink()
    if what in ("shard", "index"):
        index = {"weight_map": {"layer.weight": "model.safetensors", "layer.bias": "model.safetensors"}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    if what == "adapter_config":
        folder = adapter_folder(shared_dir / "a")
    locked = {
        "safetensors": folder / "model.safetensors",
        "bin": folder / "pytorch_model.bin",
        "folder": folder,
        "shard": folder / "model.safetensors",
        "adapter_config": folder / "adapter_config.json",
        "index": folder / "model.safetensors.index.json",
    }[what]
    locked.chmod(0)
    with unprivileged(), pytest.raises(SourceError) as err:
        (open_adapter(folder) if what == "adapter_config" else open_source(folder)).infos()
    message = one_line(err)
    assert f"{locked}" in message and "permission denied" in message
    for wrong in ("does not exist", "missing", "No such file", "corrupt", "truncated"):
        assert wrong not in message


@pytest.mark.parametrize("route", ["before-load", "pread", "before-map", "after-map"])
def test_safetensors_truncated_while_reading_names_file_and_tensor(tmp_path, monkeypatch, route):
    import mmap

    import specmerge.io.formats.safetensors_format as safetensors_format

    path = tmp_path / "w.safetensors"
    save_file({"a": torch.ones(8), "big": torch.ones(64 * 1024)}, path)
    source = open_source(path)
    assert source.infos()["big"].shape == (64 * 1024,)
    assert torch.equal(source.load("a"), torch.ones(8))
    size, short = path.stat().st_size, path.stat().st_size - 100_000
    if route in ("before-load", "pread"):
        os.truncate(path, short)
    if route == "pread":

        def no_maps(*args):
            raise OSError("no memory maps here")

        monkeypatch.setattr(safetensors_format, "mapped", no_maps)
    if route == "before-map":  # truncated after specmerge's size check, before Python's mmap checks it again
        real_fstat = os.fstat

        def stale_fstat(fd):
            monkeypatch.setattr(safetensors_format.os, "fstat", real_fstat)
            os.truncate(path, short)
            return os.stat_result((*tuple(real_fstat(fd))[:6], size, *tuple(real_fstat(fd))[7:]))

        monkeypatch.setattr(safetensors_format.os, "fstat", stale_fstat)
    if route == "after-map":  # truncated once mapped: faulting the pages in fails (EFAULT), not SIGBUS later
        real_mmap = mmap.mmap

        def map_then_truncate(*args, **kwargs):
            region = real_mmap(*args, **kwargs)
            os.truncate(path, short)
            return region

        monkeypatch.setattr(safetensors_format.mmap, "mmap", map_then_truncate)
    with pytest.raises(SourceError) as err:
        source.load("big")
    monkeypatch.undo()
    message = one_line(err)
    assert message.startswith(f"{path}: truncated while reading tensor 'big' (the file has {short} bytes")
    assert path.stat().st_size == short


def test_pytorch_checkpoint_truncated_while_reading_is_named_not_a_crash(tmp_path):
    # In a child process: before the fix, reading the mapped tensor killed the process with SIGBUS.
    path = tmp_path / "w.bin"
    torch.save({"big": torch.ones(256 * 1024)}, path)
    code = (
        "import os, sys\n"
        "from specmerge.io.formats.protocol import SourceError\n"
        "from specmerge.io.formats.sources import open_source\n"
        f"source = open_source({str(path)!r}); source.infos()\n"
        f"os.truncate({str(path)!r}, 4096)\n"
        "try:\n    float(source.load('big').sum())\n"
        "except SourceError as err:\n    print(err); sys.exit(3)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stderr
    assert done.stdout.startswith(f"{path}: truncated while reading tensor 'big' (the file had ")


@pytest.mark.parametrize("kind", ["folder", "loop", "dangling", "missing"])
def test_a_shard_that_is_not_a_file_says_what_it_is(tmp_path, kind):
    folder = tmp_path / "m"
    folder.mkdir()
    shard = folder / "model-00001-of-00001.safetensors"
    index = {"weight_map": {"layer.weight": shard.name, "layer.bias": shard.name}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    if kind == "folder":
        shard.mkdir()
    elif kind == "loop":
        shard.symlink_to(shard.name)
    elif kind == "dangling":
        shard.symlink_to("gone.safetensors")
    expected = {
        "folder": "is a folder, not a file",
        "loop": ": symbolic link loop",
        "dangling": "is a symbolic link to gone.safetensors, which does not exist",
        "missing": f"is missing from {folder}",
    }[kind]
    with pytest.raises(SourceError) as err:
        open_source(folder).infos()
    message = one_line(err)
    assert message.startswith(f"{folder}/model.safetensors.index.json: shard {shard.name} (holding 'layer.weight')")
    assert expected in message
    if kind != "missing":
        assert "missing" not in message

    # The same for a folder's model.safetensors (not "holds no checkpoint").
    (folder / "model.safetensors.index.json").unlink()
    if kind != "missing":
        shard.rename(folder / "model.safetensors") if kind != "loop" else (folder / "model.safetensors").symlink_to(
            "model.safetensors"
        )
        with pytest.raises(SourceError, match=expected.replace(".", r"\.") if kind != "dangling" else "which does not"):
            open_source(folder)


def test_merge_of_sources_linked_inside_their_folders_still_works(tmp_path):
    """Links that stay inside a model folder are fine (a smoke test of the positive side of the rule)."""
    base, experts = family(tmp_path)
    (experts[0] / "weights").mkdir()
    (experts[0] / "model.safetensors").rename(experts[0] / "weights" / "w.safetensors")
    (experts[0] / "model.safetensors").symlink_to(Path("weights", "w.safetensors"))
    (base / "tokenizer.json").write_text("{}")
    (base / "tokenizer_config.json").symlink_to("tokenizer.json")
    merge(base, experts, tmp_path / "out", **FAST)
    assert (tmp_path / "out" / "tokenizer_config.json").read_text() == "{}"
    assert set(load_file(tmp_path / "out" / "model.safetensors")) == {"layer.weight", "layer.bias"}


def test_the_config_of_a_base_given_as_its_index_is_read_only_from_its_folder(tmp_path):
    base, experts = family(tmp_path)
    index = {"weight_map": {"layer.weight": "model.safetensors", "layer.bias": "model.safetensors"}}
    (base / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "private.json").write_text('{"model_type": "gpt2"}')
    (base / "config.json").unlink()
    (base / "config.json").symlink_to(tmp_path / "home" / "private.json")
    pattern = rf"config\.json is a symbolic link to {tmp_path}/home/private\.json, outside"
    with pytest.raises(SourceError, match=pattern):
        merge(base / "model.safetensors.index.json", experts, tmp_path / "out", **FAST)
    assert not (tmp_path / "out").exists()
