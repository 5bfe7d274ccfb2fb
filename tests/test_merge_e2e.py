"""Whole-model merges of tiny transformers models, checked tensor by tensor against the per-tensor functions."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from specmerge import all_methods, get_method
from specmerge.cli import main
from specmerge.pipeline.run.api import merge
from tiny_models import ARCHITECTURES, build_family, dummy_inputs, expert_count

KEYS = ["math", "code", "chat"]
FAST = {"steps": 3}  # iterative methods: a few steps keep the suite fast; the math is tested elsewhere


def method_params(name: str) -> dict:
    known = {p.name for p in get_method(name).params}
    return {k: v for k, v in FAST.items() if k in known}


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {arch: build_family(root, arch) for arch in ARCHITECTURES}


def load_weights(folder) -> dict[str, torch.Tensor]:
    weights = {}
    for file in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(file))
    return weights


def expected_tensor(row: dict, base: dict, experts: list[dict], params: dict) -> torch.Tensor:
    """The per-tensor function applied directly to the same inputs (independent of the executor)."""
    name = row["name"]
    b = base[name]
    if row["action"] == "keep_base":
        return b
    stack = torch.stack([e[name].float() for e in experts]) - b.float()
    if row["action"] == "average":
        delta = stack.mean(dim=0)
    else:
        method = get_method(row["method"])
        whole = {"base": b.float()} if method.needs_base else {}  # slerp, karcher
        delta = method(stack, tensor_name=name, **whole, **params).delta  # DARE: seeded by content
    return (b.float() + delta).to(b.dtype)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("method", sorted(all_methods()))
def test_merge_every_method_golden_and_loadable(families, tmp_path, arch, method):
    base_dir, expert_dirs = families[arch]
    out = tmp_path / "merged"
    params = method_params(method)
    expert_dirs = expert_dirs[: expert_count(get_method(method), len(expert_dirs))]  # slerp: one, nuslerp: two
    keys = KEYS[: len(expert_dirs)]
    report = merge(base_dir, expert_dirs, out, method=method, params=params, expert_keys=keys, progress=False)

    base, experts, merged = load_weights(base_dir), [load_weights(e) for e in expert_dirs], load_weights(out)
    assert merged.keys() == base.keys()
    rows = {row["name"]: row for row in report["tensors"]}
    assert rows.keys() == base.keys()
    for name, tensor in merged.items():
        assert tensor.shape == base[name].shape and tensor.dtype == base[name].dtype, name
        expected = expected_tensor(rows[name], base, experts, report["params"] if rows[name]["method"] else {})
        torch.testing.assert_close(tensor, expected, rtol=1e-5, atol=1e-6, msg=f"{arch} {method} {name}")
    # the paper's rule: 2-D linear weights get the method (passthrough, a copy of the base, merges none)
    linear = [n for n, r in rows.items() if r["action"] == "merge"]
    if method == "passthrough":
        assert not expert_dirs and not linear and all(torch.equal(merged[n], base[n]) for n in base)
    else:
        assert any(n.endswith("proj.weight") or n.endswith("dense.weight") or "fc" in n for n in linear)

    model = transformers.AutoModel.from_pretrained(out).eval()
    with torch.no_grad():
        output = model(**dummy_inputs(arch)).last_hidden_state
    assert torch.isfinite(output).all()


def test_output_folder_has_config_card_recipe_and_report(families, tmp_path):
    base_dir, expert_dirs = families["llama"]
    out = tmp_path / "m"
    merge(base_dir, expert_dirs, out, method="swudi_a", progress=False)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "README.md", "recipe.yaml", "report.json", "model.safetensors"} <= names
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left
    report = json.loads((out / "report.json").read_text())
    q = next(r for r in report["tensors"] if r["name"].endswith("layers.0.self_attn.q_proj.weight"))
    assert q["action"] == "merge" and q["diagnostics"]["kept_rank"] >= 1
    assert "SWUDI" in (out / "README.md").read_text()
    causal = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert causal.lm_head.weight.shape == (64, 32)


def test_sharded_output_and_dtype(families, tmp_path):
    base_dir, expert_dirs = families["bert"]
    out = tmp_path / "m"
    merge(base_dir, expert_dirs, out, method="ties", dtype="bfloat16", shard_size=20000, progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    merged = load_weights(out)
    assert all(t.dtype == torch.bfloat16 for t in merged.values() if t.is_floating_point())
    transformers.AutoModel.from_pretrained(out)


def test_cli_merge_and_run(families, tmp_path, capsys):
    base_dir, expert_dirs = families["clip_vision"]
    out = tmp_path / "cli"
    args = ["merge", str(base_dir), *map(str, expert_dirs), "-o", str(out), "-m", "swudi", "-p", "t=300", "-q"]
    assert main(args) == 0
    assert "merged" in capsys.readouterr().out
    # the same output again is refused, the folder untouched
    before = (out / "model.safetensors").stat().st_mtime_ns
    assert main(args) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "model.safetensors").stat().st_mtime_ns == before
    # the recipe written next to the model reproduces it
    again = tmp_path / "again"  # (without fsync: the same bytes)
    assert main(["run", str(out / "recipe.yaml"), "-o", str(again), "-q", "--no-fsync"]) == 0
    assert load_weights(again).keys() == load_weights(out).keys()
    for name, tensor in load_weights(again).items():
        assert torch.equal(tensor, load_weights(out)[name]), name


def test_bad_input_fails_before_reading_and_leaves_nothing(families, tmp_path, capsys):
    base_dir, expert_dirs = families["llama"]
    out = tmp_path / "never"
    assert main(["merge", str(base_dir), str(expert_dirs[0]), "-o", str(out), "-m", "swudy"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "did you mean 'swudi'" in err
    assert main(["merge", str(base_dir), str(tmp_path / "missing"), "-o", str(out)]) == 2
    assert "missing" in capsys.readouterr().err
    assert main(["merge", str(base_dir), str(expert_dirs[0]), "-o", str(out), "-p", "rank_ration=0.5"]) == 2
    assert "unknown parameter of method 'swudi_a' 'rank_ration'" in capsys.readouterr().err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_mismatched_architectures_are_refused(families, tmp_path, capsys):
    llama_base, _ = families["llama"]
    _, bert_experts = families["bert"]
    assert main(["merge", str(llama_base), str(bert_experts[0]), "-o", str(tmp_path / "x"), "-q"]) == 2
    assert not (tmp_path / "x").exists()


def test_output_may_not_overwrite_an_input(families, capsys):
    base_dir, expert_dirs = families["llama"]
    assert main(["merge", str(base_dir), *map(str, expert_dirs), "-o", str(base_dir), "--overwrite", "-q"]) == 2
    assert "overlaps the input" in capsys.readouterr().err
    assert (base_dir / "config.json").exists()


@pytest.mark.parametrize("method", ["swudi_a", "task_arithmetic", "ties"])
def test_row_blocks_give_the_same_merge(families, tmp_path, monkeypatch, method):
    """Row-wise work (averages, TA) in blocks of a few rows equals the whole-tensor merge, byte for byte."""
    import specmerge.pipeline.run.work as work

    base_dir, expert_dirs = families["llama"]
    whole = tmp_path / "whole"
    averaged = {"merge_embeddings": False}  # the embedding averaged: row-wise work, in blocks below
    merge(base_dir, expert_dirs, whole, method=method, expert_keys=KEYS, progress=False, **averaged)
    monkeypatch.setattr(work, "BLOCK_BYTES", 200)  # a few rows per block
    assert len(work.row_blocks(_entry("average", (64, 32)), 4)) > 1
    blocks = tmp_path / "blocks"
    report = merge(base_dir, expert_dirs, blocks, method=method, expert_keys=KEYS, progress=False, **averaged)
    a, b = load_weights(whole), load_weights(blocks)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    embed = next(r for r in report["tensors"] if r["name"] == "model.embed_tokens.weight")
    assert embed["action"] == "average"


def _entry(action, shape):
    from specmerge.pipeline.plan.rules import TensorPlan

    return TensorPlan("x", shape, torch.float32, action, None, {}, "test")


def test_sources_read_row_blocks(families):
    from specmerge.io.formats.sources import open_source

    base_dir, _ = families["bert"]
    with open_source(base_dir) as source:
        name = "embeddings.word_embeddings.weight"
        full = source.load(name)
        torch.testing.assert_close(source.load(name, (3, 10)), full[3:10], rtol=0, atol=0)
        assert source.load(name, (5, 5)).shape == (0, full.shape[1])


def test_tied_weights_stay_tied(tmp_path):
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(tmp_path / "base")
    for i in range(2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
        model.save_pretrained(tmp_path / f"e{i}")
    merge(tmp_path / "base", [tmp_path / "e0", tmp_path / "e1"], tmp_path / "out", progress=False)
    assert "lm_head.weight" not in load_weights(tmp_path / "out")  # stored once, as in the base
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()


def test_device_resolution():
    from specmerge.pipeline.run.compute import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device; use --device cpu or auto"):
            resolve_device("cuda")


def test_scale_non_matrix_scales_the_averaged_tensors(families, tmp_path):
    base_dir, expert_dirs = families["bert"]
    out = tmp_path / "scaled"
    report = merge(base_dir, expert_dirs, out, params={"scale": 0.5}, scale_non_matrix=True, progress=False)
    base, experts, merged = load_weights(base_dir), [load_weights(e) for e in expert_dirs], load_weights(out)
    averaged = [r["name"] for r in report["tensors"] if r["action"] == "average"]
    assert averaged
    for name in averaged:
        mean = torch.stack([e[name] - base[name] for e in experts]).mean(dim=0)
        torch.testing.assert_close(merged[name], base[name] + 0.5 * mean, rtol=1e-5, atol=1e-6)
