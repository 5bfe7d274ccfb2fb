"""A brand-new virtualenv, as a user makes one: `pip install .` merges without the extras, every command that
needs an extra says in one line which one, and `pip install '.[hf]'` then makes `specmerge demo` run.

Slow (a venv, torch and transformers installed from the package registry, about 3 minutes on 2 cores), so
it runs only with ``SPECMERGE_INSTALL_TEST=1``: ``make test-install``. The project is built from a copy of
its files (tracked and untracked-not-ignored, as ``git ls-files`` lists them), so the build writes no
``build/`` into the work tree and no stale file there can hide a missing one. ``-c constraints.txt`` keeps
torch the pinned CPU wheel.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[1]
OPTIONAL = ("transformers", "tokenizers", "matplotlib")  # what `import specmerge` must never import

pytestmark = [
    pytest.mark.install,
    pytest.mark.skipif(
        os.environ.get("SPECMERGE_INSTALL_TEST") != "1",
        reason="builds a fresh virtualenv (minutes): SPECMERGE_INSTALL_TEST=1 pytest -m install (make test-install)",
    ),
]


@dataclass(frozen=True)
class Venv:
    """A virtualenv (no system site-packages, no user site) and the copy of the project it installs from."""

    root: Path
    project: Path

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    def env(self, path: str | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env.update(PYTHONNOUSERSITE="1", PATH=path if path is not None else f"{self.bin}{os.pathsep}{env['PATH']}")
        return env

    def run(self, *argv: str | Path, cwd: Path, path: str | None = None, timeout: int = 600):
        """Run a program of the venv (``argv[0]`` names it); the finished process, output captured as text."""
        command = [str(self.bin / argv[0]), *map(str, argv[1:])]
        return subprocess.run(command, cwd=cwd, env=self.env(path), capture_output=True, text=True, timeout=timeout)

    def pip_install(self, requirement: str) -> None:
        """``pip install -c constraints.txt REQUIREMENT`` from the project copy, as a user runs it."""
        done = self.run("python", "-m", "pip", "install", "-q", "-c", "constraints.txt", requirement,
                        cwd=self.project, timeout=1800)  # fmt: skip
        assert done.returncode == 0, f"pip install {requirement} failed:\n{done.stdout}\n{done.stderr}"

    def has(self, module: str) -> bool:
        code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
        return self.run("python", "-c", code, cwd=self.root).returncode == 0


def copy_project(target: Path) -> Path:
    """The project's files (tracked, and untracked but not ignored) copied into ``target``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True, timeout=60,
    ).stdout.decode()  # fmt: skip
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():  # a tracked file deleted in the work tree is not part of what gets committed
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Venv]:
    """A new venv with ``pip install -c constraints.txt .`` done; removed afterwards (it holds about 1.5 GB)."""
    top = tmp_path_factory.mktemp("fresh-install")
    made = Venv(top / "venv", copy_project(top / "project"))
    subprocess.run([sys.executable, "-m", "venv", str(made.root)], check=True, timeout=300)
    try:
        made.pip_install(".")
        yield made
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny base and two experts: folders with config.json and model.safetensors (2-D weights and a norm)."""
    folder = tmp_path_factory.mktemp("models")
    generator = torch.Generator().manual_seed(0)
    names = [f"model.layers.{i}.mlp.{p}.weight" for i in range(2) for p in ("up_proj", "down_proj")]
    base = {name: torch.randn(16, 12, generator=generator) for name in names}
    base["model.norm.weight"] = torch.ones(12)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 12}
    for label, scale in (("base", 0.0), ("expert0", 0.1), ("expert1", 0.1)):
        (folder / label).mkdir()
        tensors = {k: v + scale * torch.randn(v.shape, generator=generator) for k, v in base.items()}
        save_file(tensors, folder / label / "model.safetensors", metadata={"format": "pt"})
        (folder / label / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture
def bare(venv: Venv) -> Venv:
    """The venv before any extra is installed (the tests of this file run in order: the [hf] one comes last)."""
    for module in OPTIONAL:
        assert not venv.has(module), f"{module} is installed in the fresh venv: `pip install .` must not pull it"
    return venv


def one_line_error(done: subprocess.CompletedProcess) -> str:
    """The single stderr line of a command that exited 2 (no traceback, nothing else)."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_the_install_is_consistent_and_imports_nothing_optional(bare: Venv):
    assert bare.run("python", "-m", "pip", "check", cwd=bare.root).returncode == 0
    from specmerge.version import __version__

    code = "import specmerge, specmerge.cli, specmerge_bench.cli; print(specmerge.__version__)"
    done = bare.run("python", "-c", code, cwd=bare.root)
    assert (done.returncode, done.stdout.strip()) == (0, __version__), done.stderr  # no top-level optional import
    lines = (REPO / "constraints.txt").read_text().splitlines()
    pins = dict(line.strip().split("==") for line in lines if "==" in line and not line.startswith("#"))
    code = "import torch; print(torch.__version__.partition('+')[0], torch.version.cuda)"
    torch_build = bare.run("python", "-c", code, cwd=bare.root)
    assert torch_build.stdout.split() == [pins["torch"], "None"], torch_build.stderr  # the pinned CPU wheel


def test_the_core_commands_run_without_extras(bare: Venv, tmp_path: Path):
    from specmerge.version import __version__

    version = bare.run("specmerge", "--version", cwd=tmp_path)
    assert (version.returncode, version.stdout.strip()) == (0, f"specmerge {__version__}")
    methods = bare.run("specmerge", "methods", cwd=tmp_path)
    assert methods.returncode == 0, methods.stderr
    assert "swudi_a" in methods.stdout and "ties" in methods.stdout
    schema = bare.run("specmerge", "schema", cwd=tmp_path)
    assert schema.returncode == 0, schema.stderr
    assert json.loads(schema.stdout)["type"] == "object"


@pytest.mark.parametrize("method", ["swudi_a", "ties"])
def test_a_merge_without_extras_equals_the_work_tree_merge(bare: Venv, models: Path, tmp_path: Path, method: str):
    """The installed copy merges, and bit for bit as the work tree's code does (same torch, one thread)."""
    inputs = [models / "base", models / "expert0", models / "expert1"]
    argv = ["merge", *inputs, "-m", method, "-q", "--threads", "1", "-o"]
    done = bare.run("specmerge", *argv, tmp_path / "installed", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    reference = subprocess.run([sys.executable, "-m", "specmerge", *map(str, argv), str(tmp_path / "tree")],
                               capture_output=True, text=True, timeout=600)  # fmt: skip
    assert reference.returncode == 0, reference.stderr
    merged, expected = (load_file(tmp_path / out / "model.safetensors") for out in ("installed", "tree"))
    base = load_file(models / "base" / "model.safetensors")
    assert merged.keys() == expected.keys() == base.keys()
    for name, tensor in merged.items():
        assert torch.equal(tensor, expected[name]), name
        assert (tensor.shape, tensor.dtype) == (base[name].shape, base[name].dtype), name
        if tensor.dim() == 2:
            assert not torch.equal(tensor, base[name]), f"{name} was not merged"
    assert json.loads((tmp_path / "installed" / "config.json").read_text())["model_type"] == "llama"


def test_demo_without_hf_names_the_extra(bare: Venv, tmp_path: Path):
    done = bare.run("specmerge", "demo", "--workdir", tmp_path / "demo", cwd=tmp_path)
    assert one_line_error(done) == (
        "specmerge: error: this command needs transformers (optional): pip install 'specmerge[hf]'"
    )
    assert done.stdout == ""


def test_inspect_plots_without_matplotlib_names_the_extra(bare: Venv, models: Path, tmp_path: Path):
    inputs = [models / "base", models / "expert0", models / "expert1"]
    done = bare.run("specmerge", "inspect", *inputs, "-o", tmp_path / "report", "-q", cwd=tmp_path)
    assert "pip install 'specmerge[plots]'" in one_line_error(done)
    assert not (tmp_path / "report").exists()
    tables = bare.run("specmerge", "inspect", *inputs, "-o", tmp_path / "tables", "-q", "--no-plots", cwd=tmp_path)
    assert tables.returncode == 0, tables.stderr
    assert (tmp_path / "tables" / "report.md").is_file()


def test_the_accuracy_benchmark_without_its_extra_names_it(bare: Venv, tmp_path: Path):
    # PATH holds only the venv: should the benchmark get as far as fetching its data, apt-get is not found
    done = bare.run("specmerge-bench", "accuracy", "--cache", tmp_path / "cache", cwd=tmp_path, path=str(bare.bin))
    assert "pip install 'specmerge[bench]'" in one_line_error(done)


def test_the_speed_benchmark_needs_no_extra(bare: Venv, tmp_path: Path):
    argv = ["speed", "--sets", "tiny", "--methods", "ties", "--repeats", "1", "--json", tmp_path / "speed.json"]
    done = bare.run("specmerge-bench", *argv, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "speed.json").is_file()


def test_with_hf_the_demo_runs_and_import_stays_light(venv: Venv, tmp_path: Path):
    venv.pip_install(".[hf]")
    assert venv.has("transformers") and not venv.has("matplotlib")
    done = venv.run("specmerge", "demo", "--workdir", tmp_path / "demo", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "swudi_a" in done.stdout and "own-input interference" in done.stdout
    code = (
        "import sys, specmerge, specmerge.cli, specmerge_bench.cli\n"
        f"print(sorted(m for m in sys.modules if m.partition('.')[0] in {OPTIONAL!r}))"
    )
    loaded = venv.run("python", "-c", code, cwd=tmp_path)
    assert (loaded.returncode, loaded.stdout.strip()) == (0, "[]"), loaded.stderr
