"""DARE's masks come from the experts' weights, not their folder names or places (issue 16)."""

from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file

from specmerge.cli import main
from tiny_models import build_family


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return build_family(tmp_path_factory.mktemp("family"), "llama", n_experts=3)


def merged(folder):
    return load_file(folder / "model.safetensors")


@pytest.mark.parametrize("method", ["dare_ties", "dare_task_arithmetic"])
def test_renamed_copies_of_the_experts_give_the_same_merge(family, tmp_path, method):
    base, experts = family
    copies = []
    for i, expert in enumerate(experts):
        copies.append(tmp_path / f"renamed-{i}-{expert.name[::-1]}")
        shutil.copytree(expert, copies[-1])
    common = ["-m", method, "--threads", "1", "-q"]
    assert main(["merge", str(base), *map(str, experts), "-o", str(tmp_path / "a"), *common]) == 0
    assert main(["merge", str(base), *map(str, copies), "-o", str(tmp_path / "b"), *common]) == 0
    a, b = merged(tmp_path / "a"), merged(tmp_path / "b")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    # another seed, or other experts, give other masks
    assert main(["merge", str(base), *map(str, experts), "-o", str(tmp_path / "c"), *common, "-p", "seed=1"]) == 0
    c = merged(tmp_path / "c")
    assert any(not a[k].equal(c[k]) for k in a if k.endswith("q_proj.weight"))
    assert main(["merge", str(base), *map(str, experts[:2]), "-o", str(tmp_path / "d"), *common]) == 0
    d = merged(tmp_path / "d")
    assert any(not a[k].equal(d[k]) for k in a if k.endswith("q_proj.weight"))
