"""A command that needs an optional dependency that is not installed says, in one line, which extra installs it."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

BLOCK = """
import sys
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == {module!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Blocker())
from specmerge.cli import main
sys.exit(main({argv!r}))
"""


@pytest.mark.parametrize(("module", "argv", "extra"), [("transformers", ["demo"], "hf")])
def test_a_missing_optional_dependency_names_its_extra(tmp_path, module, argv, extra):
    code = BLOCK.format(module=module, argv=[*argv, "--workdir", str(tmp_path / "w")])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"specmerge: error: this command needs {module} (optional): pip install 'specmerge[{extra}]'"
    ]


def test_the_extras_named_exist():
    from specmerge.cli import OPTIONAL_EXTRAS

    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    extras = extras["optional-dependencies"]
    for module, extra in OPTIONAL_EXTRAS.items():
        assert extra in extras, extra
        assert module == "tokenizers" or any(req.startswith(module) for req in extras[extra]), (module, extra)
    assert set(extras["all"]) >= set(extras["hf"]) | set(extras["plots"])
