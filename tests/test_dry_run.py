"""``specmerge merge/run --dry-run``: the plan with its routes, bytes, peak memory and time, and nothing written.

Built on tiny local models (``tiny_models``): full-checkpoint experts and PEFT LoRA adapters. The dry run must
leave no output folder and leave the inputs as they were; its byte counts are checked against the tensors'
sizes read independently from the files' headers (``safetensors``); its routes against what the real merge of
the same recipe reports for every tensor. No timing is asserted: the machines are shared.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from specmerge.cli import main
from specmerge.pipeline.estimate.dryrun import dry_run, format_estimate
from specmerge.pipeline.recipe.model import Recipe
from specmerge.pipeline.run.api import merge, merge_recipe
from tiny_models import build_family, save_adapter

KEYS = ["e0", "e1", "e2"]
REPORTED_ROUTE = {"linear": "linear", "sum": "sum", "dense": "dense", "factored": "factored", "unchanged": "unchanged"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_family(tmp_path_factory.mktemp("dry"), "llama")


@pytest.fixture(scope="module")
def adapters(llama, tmp_path_factory):
    base, _ = llama
    root = tmp_path_factory.mktemp("dry-lora")
    return [
        save_adapter(base, root / "a0", 1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        save_adapter(base, root / "a1", 2, r=2, lora_alpha=4, target_modules=["q_proj", "o_proj", "up_proj"]),
    ]


def snapshot(folders: list[Path]) -> dict[str, tuple[str, int]]:
    """Every file under ``folders``: its SHA-256 and modification time (ns)."""
    return {
        str(p): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
        for folder in folders
        for p in sorted(Path(folder).rglob("*"))
        if p.is_file()
    }


def stored_bytes(folder: Path) -> dict[str, int]:
    """Bytes of every tensor of a folder's safetensors files, from their headers."""
    sizes = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            names = f.keys()
            for name in names:
                part = f.get_slice(name)
                itemsize = torch.empty(0, dtype=getattr(torch, _DTYPES[part.get_dtype()])).element_size()
                sizes[name] = math.prod(part.get_shape()) * itemsize
    return sizes


_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64"}


def lora_bytes(adapter: Path) -> dict[str, int]:
    """Bytes of each adapted base weight's two factors (lora_A + lora_B), by the base weight's name."""
    sizes: dict[str, int] = {}
    for name, nbytes in stored_bytes(adapter).items():
        module = name.removeprefix("base_model.model.").replace(".lora_A.weight", "").replace(".lora_B.weight", "")
        sizes[module + ".weight"] = sizes.get(module + ".weight", 0) + nbytes
    return sizes


def test_dry_run_prints_the_plan_and_writes_nothing(llama, tmp_path, capsys):
    base, experts = llama
    before = snapshot([base, *experts])
    out = tmp_path / "merged"
    argv = ["merge", str(base), *map(str, experts), "-o", str(out), "--dry-run", *[f"--expert-key={k}" for k in KEYS]]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert not out.exists() and list(tmp_path.iterdir()) == []
    assert snapshot([base, *experts]) == before
    assert "dry run: swudi_a merge" in text and "nothing written" in text
    assert "2-D linear weight" in text and "embedding" in text  # the plan's reasons, as given
    for part in ("by route:", "read:", "write:", "memory: peak", "time:", "assumed: a rank rule"):
        assert part in text


def test_without_output_folder_and_refusals(llama, tmp_path, capsys):
    base, experts = llama
    assert main(["merge", str(base), *map(str, experts), "--dry-run"]) == 0  # -o is optional with --dry-run
    assert "dry run" in capsys.readouterr().out
    assert main(["merge", str(base), *map(str, experts)]) == 2
    assert "-o/--output is required" in capsys.readouterr().err
    assert main(["merge", str(base), *map(str, experts), "-o", str(tmp_path / "x"), "--json"]) == 2
    assert "--json prints a dry run's estimate: add --dry-run" in capsys.readouterr().err
    existing = tmp_path / "exists"
    existing.mkdir()
    (existing / "mine.txt").write_text("keep")
    assert main(["merge", str(base), *map(str, experts), "-o", str(existing), "--dry-run"]) == 2  # checked as a merge
    assert "already exists" in capsys.readouterr().err
    assert (existing / "mine.txt").read_text() == "keep"


@pytest.mark.parametrize("method", ["swudi_a", "task_arithmetic", "ties"])
def test_bytes_add_up_and_routes_match_the_real_merge(llama, tmp_path, capsys, method):
    base, experts = llama
    argv = ["merge", str(base), *map(str, experts), "--dry-run", "--json", "-m", method]
    assert main([*argv, *[f"--expert-key={k}" for k in KEYS]]) == 0
    estimate = json.loads(capsys.readouterr().out)  # the JSON form parses
    rows = {row["name"]: row for row in estimate["tensors"]}
    in_base, in_experts = stored_bytes(base), [stored_bytes(e) for e in experts]
    for name, row in rows.items():
        expected = in_base[name] + (0 if row["action"] == "keep_base" else sum(e[name] for e in in_experts))
        assert row["read_bytes"] == expected, name
    total = estimate["total"]
    assert total["read_bytes"] == sum(in_base.values()) + sum(sum(e.values()) for e in in_experts)
    assert total["write_bytes"] == estimate["summary"]["bytes"] == sum(in_base.values())  # float32 in and out
    assert estimate["inputs"]["base"]["read_bytes"] == sum(in_base.values())
    assert sum(g["tensors"] for g in estimate["groups"]) == total["tensors"] == len(rows)
    assert math.isclose(sum(g["seconds"] for g in estimate["groups"]), total["seconds"] - total["prepare_s"])
    assert sum(r["read_bytes"] for r in estimate["routes"].values()) == total["read_bytes"]
    assert estimate["peak_memory"]["bytes"] > estimate["peak_memory"]["process_baseline"] > 0

    report = merge(base, experts, tmp_path / "out", method=method, expert_keys=KEYS, progress=False)
    for tensor in report["tensors"]:
        route = rows[tensor["name"]]["route"]
        assert REPORTED_ROUTE.get(route) == tensor["diagnostics"].get("route"), tensor["name"]
    if method == "task_arithmetic":  # linear: every tensor in chunks, the embeddings averaged the same way
        assert {row["route"] for row in rows.values()} == {"linear"}
    else:  # the method's tensors as a stack (swudi_a: 2-D weights; ties: all, embeddings too), the rest averaged
        assert all(row["route"] == ("dense" if row["action"] == "merge" else "linear") for row in rows.values())
        assert {row["action"] for row in rows.values()} == ({"merge", "average"} if method == "swudi_a" else {"merge"})


def test_lora_experts_go_factored_and_unchanged(llama, adapters, tmp_path, capsys):
    base, _ = llama
    recipe = merge_recipe(base, adapters, method="swudi_a", expert_keys=["a0", "a1"])
    estimate = dry_run(recipe, tensors=True)
    rows = {row["name"]: row for row in estimate["tensors"]}
    adapted = [lora_bytes(a) for a in adapters]
    in_base = stored_bytes(base)
    for name, row in rows.items():
        changed = any(name in a for a in adapted)
        if row["action"] == "merge" and changed:
            assert row["route"] == "factored", name
        elif row["action"] != "keep_base":
            assert row["route"] == "unchanged", name  # no adapter changes it: W_0
        assert row["read_bytes"] == in_base[name] + sum(a.get(name, 0) for a in adapted), name
    assert {"factored", "unchanged"} <= set(estimate["routes"])
    report = merge(base, adapters, tmp_path / "out", method="swudi_a", expert_keys=["a0", "a1"], progress=False)
    for tensor in report["tensors"]:
        assert REPORTED_ROUTE[rows[tensor["name"]]["route"]] == tensor["diagnostics"].get("route"), tensor["name"]
    # a method that densifies LoRA experts: the stack and the method
    ties = dry_run(merge_recipe(base, adapters, method="ties"), tensors=True)
    assert {row["route"] for row in ties["tensors"] if row["name"] in adapted[1]} == {"dense"}


def test_recipe_with_overrides_keep_base_and_average(llama, tmp_path, capsys):
    base, experts = llama
    recipe_file = tmp_path / "recipe.yaml"
    recipe = Recipe.from_dict(
        {
            "base": str(base),
            "experts": [str(e) for e in experts],
            "method": "swudi_a",
            "overrides": [
                {"pattern": "*.mlp.*", "action": "keep_base"},
                {"pattern": "*.self_attn.o_proj.weight", "action": "average"},
            ],
        }
    )
    recipe_file.write_text(recipe.to_yaml())
    assert main(["run", str(recipe_file), "--dry-run", "--json", "-o", str(tmp_path / "out")]) == 0
    estimate = json.loads(capsys.readouterr().out)
    assert not (tmp_path / "out").exists()
    rows = {row["name"]: row for row in estimate["tensors"]}
    in_base = stored_bytes(base)
    for name, row in rows.items():
        if ".mlp." in name:
            assert (row["action"], row["route"], row["read_bytes"]) == ("keep_base", "keep_base", in_base[name])
            assert row["reason"] == "override '*.mlp.*'"
        elif name.endswith("o_proj.weight"):
            assert (row["action"], row["route"]) == ("average", "linear")
    groups = [g for g in estimate["groups"] if g["action"] == "keep_base"]
    assert groups and all(g["reasons"] == {"override '*.mlp.*'": g["tensors"]} for g in groups)
    text = format_estimate(estimate)
    assert "keep_base" in text and "override '*.mlp.*'" in text


def test_python_entry_point_and_adapter_output(llama, adapters):
    base, experts = llama
    estimate = dry_run(merge_recipe(base, experts, method="task_arithmetic"))
    assert estimate["total"]["items"] >= estimate["total"]["tensors"] > 0 and "tensors" not in estimate
    json.dumps(estimate)  # JSON-ready as returned
    lora = dry_run(merge_recipe(base, adapters, method="swudi_a", output_format="lora"), tensors=True)
    assert "base" not in lora["inputs"]  # an adapter output does not read the base
    assert lora["total"]["write_bytes"] == 0 and {row["route"] for row in lora["tensors"]} == {"factored"}
