"""The output folder's missing parents are created, said, and removed again when the merge fails (issue 16)."""

from __future__ import annotations

import pytest

from specmerge.cli import main
from tiny_models import build_family, poisoned_copy


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    return build_family(tmp_path_factory.mktemp("family"), "llama", n_experts=2)


def test_missing_parents_are_created_and_said(family, tmp_path, capsys):
    base, experts = family
    out = tmp_path / "runs" / "2026" / "merged"
    assert main(["merge", str(base), *map(str, experts), "-o", str(out), "-m", "task_arithmetic", "-q"]) == 0
    assert (out / "model.safetensors").is_file()
    capsys.readouterr()
    again = tmp_path / "more" / "merged"
    assert main(["merge", str(base), *map(str, experts), "-o", str(again), "-m", "task_arithmetic"]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "created the folder" in line]
    assert said == [f"specmerge: created the folder {tmp_path / 'more'} for the output"]


def test_a_failed_merge_removes_the_parents_it_created(family, tmp_path, capsys):
    base, experts = family
    broken, _ = poisoned_copy(experts[0], tmp_path / "broken", lambda n: n.endswith("q_proj.weight"))
    out = tmp_path / "new" / "deeper" / "merged"
    assert main(["merge", str(base), str(broken), str(experts[1]), "-o", str(out), "-q"]) != 0
    assert "NaN" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()  # nothing left behind: the folders made for it are gone


def test_a_file_in_the_way_is_one_line(family, tmp_path, capsys):
    base, experts = family
    (tmp_path / "plain").write_text("not a folder")
    assert main(["merge", str(base), *map(str, experts), "-o", str(tmp_path / "plain" / "x" / "out"), "-q"]) != 0
    err = capsys.readouterr().err.strip()
    assert err == f"specmerge: error: cannot write {tmp_path / 'plain' / 'x' / 'out'}: {tmp_path / 'plain'} is not a " \
        "folder; choose another output path"  # fmt: skip
