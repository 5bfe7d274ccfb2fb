"""The output side under hostile conditions (issue 13, items 5, 6, 14-16): --overwrite replaces only specmerge's own
output, signals and kills leave no model-like leftovers, stale work folders of dead processes are removed, messages
name the user's path, a full disk says how much is needed, the config states the written dtype."""

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from specmerge.cli import main
from specmerge.io.formats.protocol import TensorInfo
from specmerge.io.output.folder import OUTPUT_MARKER, OutputError, atomic_directory, check_output, foreign_entries
from specmerge.io.output.model_files import write_output_config
from specmerge.io.output.work_folders import WORK_INFIX, remove_stale_work_folders, this_process
from specmerge.io.output.writer import ShardWriter
from specmerge.pipeline.run.api import merge
from tiny_models import build_family

SHAPES = {f"blocks.{i}.proj.weight": (8, 6) for i in range(4)}


def family(root: Path) -> tuple[Path, list[Path]]:
    """A base folder (four 8 x 6 weights and a config.json) and two experts of it (the base and a small update: an
    unrelated random "expert" would be warned about, even under -q)."""
    folders = []
    base = {k: torch.randn(s, generator=torch.Generator().manual_seed(0)) for k, s in SHAPES.items()}
    for i, name in enumerate(["base", "e1", "e2"]):
        folder = root / name
        folder.mkdir()
        g = torch.Generator().manual_seed(i)
        weights = {k: w + (0.02 * torch.randn(w.shape, generator=g) if i else 0) for k, w in base.items()}
        save_file(weights, str(folder / "model.safetensors"))
        (folder / "config.json").write_text(json.dumps({"architectures": ["Test"], "torch_dtype": "float32"}))
        folders.append(folder)
    return folders[0], folders[1:]


def cli_merge(base: Path, experts: list[Path], out: Path | str, *extra: str) -> int:
    return main(["merge", str(base), *map(str, experts), "-o", str(out), "-m", "task_arithmetic", "-q", *extra])


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if WORK_INFIX in p.name)


# --- item 5: --overwrite replaces only an empty folder or specmerge's own output -------------------------------


def test_overwrite_refuses_a_folder_specmerge_did_not_write(tmp_path, capsys):
    base, experts = family(tmp_path)
    out = tmp_path / "out"
    (out / "photos").mkdir(parents=True)
    (out / "thesis.tex").write_text("years of work")
    assert cli_merge(base, experts, out, "--overwrite") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("specmerge: error: ")
    assert str(out) in err and "not a folder specmerge wrote" in err and "2 entries: photos/, thesis.tex" in err
    assert (out / "thesis.tex").read_text() == "years of work" and (out / "photos").is_dir()
    assert not leftovers(tmp_path)
    assert cli_merge(base, experts, out) == 2  # without --overwrite: no hint that it would help
    assert "already exists; choose another path (--overwrite replaces only" in capsys.readouterr().err


def test_overwrite_replaces_an_empty_folder_and_specmerge_output_only(tmp_path, capsys):
    base, experts = family(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    assert cli_merge(base, experts, out, "--overwrite") == 0  # an empty folder
    marker = json.loads((out / OUTPUT_MARKER).read_text())
    assert marker["written_by"] == "specmerge" and set(marker["files"]) == {p.name for p in out.iterdir()} - {
        OUTPUT_MARKER
    }
    assert cli_merge(base, experts, out, "--overwrite") == 0  # its own output

    (out / "notes.txt").write_text("mine")  # specmerge's output plus a file of the user's
    assert cli_merge(base, experts, out, "--overwrite") == 2
    err = capsys.readouterr().err
    assert "is specmerge's output but also holds 1 entry: notes.txt" in err
    assert (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    (out / "model.safetensors").unlink()
    (out / "model.safetensors").mkdir()  # a listed name that is now a folder is not specmerge's
    assert foreign_entries(out) == ["model.safetensors/"]


def test_outputs_of_earlier_versions_are_recognised(tmp_path):
    merged = tmp_path / "merged"  # report.json listing its files beside recipe.yaml
    merged.mkdir()
    files = ["README.md", "config.json", "model.safetensors", "recipe.yaml", "report.json"]
    for name in files:
        (merged / name).write_text("x")
    (merged / "report.json").write_text(json.dumps({"specmerge": "0.1.0", "files": files}))
    report = tmp_path / "report"  # specmerge inspect: summary.json beside report.md
    report.mkdir()
    for name in ["summary.json", "report.md", "layers.csv", "spectra.png"]:
        (report / name).write_text("x")
    (report / "summary.json").write_text(json.dumps({"specmerge": "0.1.0"}))
    assert foreign_entries(merged) == [] and foreign_entries(report) == []
    assert check_output(merged, overwrite=True) == merged

    (report / "notes.txt").write_text("mine")
    assert foreign_entries(report) == ["notes.txt"]
    (merged / "recipe.yaml").unlink()  # a report.json alone does not make a folder specmerge's
    assert foreign_entries(merged) is None
    with pytest.raises(OutputError, match="not a folder specmerge wrote"):
        check_output(merged, overwrite=True)


def test_overwrite_refuses_a_file_or_a_link(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "folder").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "folder")
    for name, kind in [("file", "a file"), ("link", "a symbolic link")]:
        with pytest.raises(OutputError, match=f"is {kind}, and --overwrite replaces only"):
            check_output(tmp_path / name, overwrite=True)
    assert (tmp_path / "file").read_text() == "x" and (tmp_path / "link").is_symlink()


# --- item 15: the current folder, its parents and the home folder are refused before any work ------------------


@pytest.mark.parametrize("where", ["cwd", "parent_of_cwd", "home"])
def test_current_parent_and_home_folders_are_refused_before_any_work(tmp_path, monkeypatch, capsys, where):
    from specmerge.pipeline.run.executor import StreamingExecutor

    base, experts = family(tmp_path)
    out = tmp_path / "out"
    assert cli_merge(base, experts, out) == 0  # specmerge's own output: replaceable, except from inside it
    (out / "sub").mkdir()
    if where == "home":
        monkeypatch.setenv("HOME", str(out))
        target = out
    else:
        monkeypatch.chdir(out / "sub" if where == "parent_of_cwd" else out)
        target = Path("..") if where == "parent_of_cwd" else Path(".")
    monkeypatch.setattr(StreamingExecutor, "run", lambda *a, **k: pytest.fail("the merge ran"))
    assert cli_merge(base, experts, target, "--overwrite") == 2
    err = capsys.readouterr().err
    what = "your home folder" if where == "home" else "the current folder"
    assert err.count("\n") == 1 and f"refusing to write the output to {out}: it is {what} or holds it" in err
    assert (out / "model.safetensors").is_file() and not leftovers(tmp_path)


# --- item 15: names near the file-name limit, messages that name the user's path, a full disk --------------------


def test_output_name_at_the_file_name_limit_works(tmp_path):
    base, experts = family(tmp_path)
    name = "é" * 127 + "x"  # 255 bytes in UTF-8
    assert len(name.encode()) == 255
    assert cli_merge(base, experts, tmp_path / name) == 0
    assert (tmp_path / name / "model.safetensors").is_file() and not leftovers(tmp_path)


def test_os_errors_name_the_output_not_the_work_folder(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(OutputError) as caught, atomic_directory(target) as work:
        raise PermissionError(errno.EACCES, "Permission denied", str(work / "model.safetensors"))
    assert str(caught.value) == f"cannot write {target / 'model.safetensors'}: Permission denied"
    assert not leftovers(tmp_path) and not target.exists()
    with pytest.raises(FileNotFoundError), atomic_directory(target):  # an input's error is not restated
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(tmp_path / "expert"))


def test_full_disk_says_how_much_is_needed_and_where(tmp_path, monkeypatch, capsys):
    base, experts = family(tmp_path)
    out = tmp_path / "out"

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    assert cli_merge(base, experts, out) == 2
    err = capsys.readouterr().err
    planned = sum(4 * rows * cols for rows, cols in SHAPES.values())  # float32
    assert err.count("\n") == 1 and WORK_INFIX not in err
    assert f"no space left on the device while writing {out}: the output needs about {planned} bytes and " in err
    assert f"free in {tmp_path}; free some space or choose another output folder" in err
    assert not out.exists() and not leftovers(tmp_path)


# --- item 6: unfinished outputs never load, and are removed once their process is gone ----------------------------


def test_an_unfinished_shard_has_no_header_and_never_loads(tmp_path):
    infos = [TensorInfo(name, shape, torch.float32) for name, shape in SHAPES.items()]
    writer = ShardWriter(tmp_path, infos)
    writer.write(infos[0].name, torch.ones(infos[0].shape))
    writer.abort()
    shard = tmp_path / "model.safetensors"
    assert shard.stat().st_size > 8 and shard.read_bytes()[:8] == bytes(8)  # full size, header length 0
    with pytest.raises(SafetensorError, match="header"), safe_open(str(shard), "pt"):
        pass


def owner(**fields) -> dict:
    return {**this_process(), "target": "out", **fields}


def work_folder(parent: Path, name: str, owner_fields: dict) -> Path:
    work = parent / f".out{WORK_INFIX}{name}"
    (work / "output").mkdir(parents=True)
    (work / "output" / "model.safetensors").write_bytes(bytes(64))
    (work / "owner.json").write_text(json.dumps(owner_fields))
    return work


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="process start times need /proc")
def test_stale_work_folders_of_dead_owners_are_removed_and_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = work_folder(tmp_path, "dead", owner(pid=int(dead.stdout), started="1"))
    reused = work_folder(tmp_path, "reused", owner(started="1"))  # this pid, but started at another time
    rebooted = work_folder(tmp_path, "rebooted", owner(boot="an earlier boot"))
    live = work_folder(tmp_path, "live", owner())
    elsewhere = work_folder(tmp_path, "elsewhere", owner(pid=int(dead.stdout), host=socket.gethostname() + "-other"))
    unmarked = work_folder(tmp_path, "unmarked", {})
    (unmarked / "owner.json").unlink()
    with atomic_directory(tmp_path / "next") as work:  # a later run writing beside them
        (work / "f").write_text("x")
    assert not stale.exists() and not reused.exists() and not rebooted.exists()
    assert live.exists() and elsewhere.exists() and unmarked.exists()


def test_a_stale_work_folder_puts_back_the_output_it_was_replacing(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    work = work_folder(tmp_path, "dead", owner(pid=int(dead.stdout)))
    (work / "replaced").mkdir()  # killed between moving the old output aside and renaming the new one in
    (work / "replaced" / "model.safetensors").write_text("the previous output")
    assert remove_stale_work_folders(tmp_path) == [work]
    assert (tmp_path / "out" / "model.safetensors").read_text() == "the previous output" and not work.exists()


BLOCKING_MERGE = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from specmerge.cli import main
    from specmerge.methods import LayerResult, register

    calls = []

    @register("test_blocker", citation="test only")
    def blocker(task_vectors):
        \"\"\"Averages, and blocks for good at the third tensor, once it has said so in the ready file.\"\"\"
        calls.append(1)
        if len(calls) == 3:
            Path(sys.argv[1]).write_text("blocked")
            while True:
                time.sleep(0.01)
        return LayerResult(task_vectors.mean(dim=0))

    sys.exit(main(sys.argv[2:]))
    """
)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_signals_during_a_merge(tmp_path, signum):
    """A real process, stopped for good inside its third tensor's merge (after the first was written), is sent a
    signal: SIGINT and SIGTERM clean up and say so in one line; after SIGKILL the work folder cannot be loaded as a
    model and the next run beside it removes it."""
    base, experts = family(tmp_path)
    out, ready = tmp_path / "out", tmp_path / "ready"
    script = tmp_path / "blocking_merge.py"
    script.write_text(BLOCKING_MERGE)
    args = ["merge", str(base), *map(str, experts), "-o", str(out), "-m", "test_blocker", "-q", "--no-fsync"]
    process = subprocess.Popen(
        [sys.executable, str(script), str(ready), *args], stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120  # only a failing merge ever reaches it
        while not ready.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if not ready.exists():
            process.kill()
            pytest.fail(f"the merge never reached the blocking method: {process.communicate()[1]}")
        process.send_signal(signum)
        _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert not out.exists()
    if signum != signal.SIGKILL:
        assert process.returncode == 128 + signum
        assert err.count("\n") == 1 and "Traceback" not in err and "no unfinished output is left behind" in err
        assert not leftovers(tmp_path)
        return
    assert process.returncode == -signal.SIGKILL
    (work,) = [tmp_path / name for name in leftovers(tmp_path)]
    assert sorted(p.name for p in (work / "output").iterdir()) == ["model.safetensors"]  # no config, no index
    with pytest.raises(SafetensorError, match="header"), safe_open(str(work / "output" / "model.safetensors"), "pt"):
        pass
    assert cli_merge(base, experts, tmp_path / "next") == 0
    assert not leftovers(tmp_path)


# --- item 16: the output's config states the dtype it was written in ---------------------------------------------


def test_bfloat16_output_loads_as_bfloat16_with_dtype_auto(tmp_path):
    transformers = pytest.importorskip("transformers")

    base, experts = build_family(tmp_path, "llama", n_experts=2)
    assert json.loads((base / "config.json").read_text())["dtype"] == "float32"
    out = tmp_path / "merged"
    merge(base, experts, out, method="task_arithmetic", dtype="bfloat16", progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert model.dtype == torch.bfloat16


def test_config_states_the_dtype_of_most_floating_weights(tmp_path):
    config = {"model_type": "x", "text_config": {"torch_dtype": "float32"}, "dtype": None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    mixed = [
        TensorInfo("big", (64, 64), torch.bfloat16),
        TensorInfo("small", (8, 8), torch.float32),
        TensorInfo("ids", (1000,), torch.int64),
    ]
    assert write_output_config(tmp_path, mixed) == "bfloat16"
    stated = json.loads((tmp_path / "config.json").read_text())
    assert stated == {**config, "dtype": "bfloat16", "torch_dtype": "bfloat16"}  # mixed: sub-configs as they were
    assert write_output_config(tmp_path, [TensorInfo("w", (2, 2), torch.float16)]) == "float16"
    stated = json.loads((tmp_path / "config.json").read_text())
    assert stated["text_config"] == {"torch_dtype": "float16"} and stated["dtype"] == stated["torch_dtype"]
    assert write_output_config(tmp_path / "missing", mixed) is None
