"""LoRA adapters as experts, end to end: merged models, merged adapters loaded by PEFT, mixed experts, bad inputs."""

from __future__ import annotations

import json

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file

from specmerge.cli import main
from specmerge.pipeline.run.api import merge
from tiny_models import build_family, llama_config, save_adapter

KEYS = ["a0", "a1", "a2"]
ADAPTERS = [  # mismatched ranks, rsLoRA, a rank pattern, different target modules
    {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "o_proj", "up_proj"], "use_rslora": True},
    {"r": 3, "lora_alpha": 6, "target_modules": ["q_proj", "v_proj", "gate_proj"], "rank_pattern": {"v_proj": 5}},
]
FACTORED = [("swudi_a", {}), ("swudi", {"t": 300.0}), ("closed_form", {}), ("task_arithmetic", {}), ("tsv_m", {}),
            ("iso_c", {}), ("weight_average", {})]  # fmt: skip
DENSIFIED = [
    ("ties", {}),
    ("dare_ties", {"drop_rate": 0.0}),
    ("wudi", {"steps": 3}),
]  # DARE masks: from each task vector's bits


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    base = root / "base"
    transformers.LlamaForCausalLM(llama_config()).save_pretrained(base)
    adapters = [save_adapter(base, root / f"a{i}", 10 + i, with_merged=True, **lora) for i, lora in enumerate(ADAPTERS)]
    merged = [root / f"a{i}-merged" for i in range(len(ADAPTERS))]
    _, full = build_family(root, "llama", n_experts=1, seed=7)  # a full fine-tune of another tiny Llama...
    full_expert = root / "full"  # ...re-based: the base above plus that model's deltas
    base_weights, other = load_file(base / "model.safetensors"), transformers.LlamaForCausalLM.from_pretrained(full[0])
    other_base = load_file(root / "llama-base" / "model.safetensors")
    moved = {k: base_weights[k] + (v - other_base[k]) for k, v in other.state_dict().items()}
    other.load_state_dict(moved)
    other.save_pretrained(full_expert)
    return {"root": root, "base": base, "adapters": adapters, "merged": merged, "full": full_expert}


def weights(folder) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def assert_same_model(a: dict, b: dict, tolerance: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        scale = max(float(b[name].norm()), 1e-12)
        assert float((a[name] - b[name]).norm()) / scale <= tolerance, name


def logits(model, seed=0) -> torch.Tensor:
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize(("method", "params"), FACTORED + DENSIFIED)
def test_adapters_merge_like_their_dense_models(family, tmp_path, method, params):
    """Adapters as experts give the model that merging PEFT's merge_and_unload checkpoints gives."""
    base, adapters, dense = family["base"], family["adapters"], family["merged"]
    from_adapters = merge(
        base, adapters, tmp_path / "a", method=method, params=params, expert_keys=KEYS, progress=False
    )
    merge(base, dense, tmp_path / "d", method=method, params=params, expert_keys=KEYS, progress=False)
    assert_same_model(weights(tmp_path / "a"), weights(tmp_path / "d"), 1e-4)
    routes = {t["name"]: t["diagnostics"].get("route") for t in from_adapters["tensors"]}
    q = "model.layers.0.self_attn.q_proj.weight"
    assert routes[q] == ("factored" if (method, params) in FACTORED else "dense")
    assert routes["model.layers.0.self_attn.k_proj.weight"] == "unchanged"  # no adapter targets k_proj
    base_weights, merged = weights(base), weights(tmp_path / "a")
    for name in ("model.layers.1.self_attn.k_proj.weight", "model.norm.weight", "model.embed_tokens.weight"):
        assert torch.equal(merged[name], base_weights[name]), name


@pytest.mark.parametrize(("method", "params"), [("swudi_a", {}), ("tsv_m", {}), ("iso_c", {}), ("task_arithmetic", {})])
def test_lora_output_loads_in_peft_and_matches_the_dense_merge(family, tmp_path, method, params):
    base, adapters = family["base"], family["adapters"]
    report = merge(
        base, adapters, tmp_path / "lora", method=method, params=params, output_format="lora", progress=False
    )
    merge(base, adapters, tmp_path / "dense", method=method, params=params, progress=False)
    config = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and report["adapter"]["max_discarded_energy"] == 0.0
    # rank at most the sum of the input ranks per module (q_proj: 4 + 2 + 3)
    ranks = {t["name"]: t["diagnostics"]["adapter_rank"] for t in report["tensors"]}
    assert 1 <= ranks["model.layers.0.self_attn.q_proj.weight"] <= 9
    assert ranks["model.layers.0.mlp.down_proj.weight"] <= 4

    base_model = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base_model, tmp_path / "lora").eval()
    dense = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "dense", dtype=torch.float32).eval()
    expected = logits(dense)
    assert float((logits(with_adapter) - expected).abs().max()) <= 1e-4 * max(1.0, float(expected.abs().max()))
    # and PEFT's own merge of the written adapter gives the dense merged weights
    unloaded = with_adapter.merge_and_unload().state_dict()
    assert_same_model({k: unloaded[k] for k in weights(tmp_path / "dense")}, weights(tmp_path / "dense"), 1e-5)


def test_max_rank_truncates_and_reports_the_discarded_energy(family, tmp_path, capsys):
    base, *adapters = map(str, (family["base"], *family["adapters"]))
    out = tmp_path / "ties"
    args = ["merge", base, *adapters, "-o", str(out), "-m", "ties", "--output-format", "lora", "-q"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "densifies LoRA experts" in err and "--max-rank" in err
    assert not out.exists()
    assert main([*args, "--max-rank", "2"]) == 0
    assert "largest discarded energy" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    q = next(t for t in report["tensors"] if t["name"] == "model.layers.0.self_attn.q_proj.weight")
    assert q["diagnostics"]["adapter_rank"] == 2 and 0 < q["diagnostics"]["discarded_energy"] < 1
    stored = load_file(out / "adapter_model.safetensors")
    assert all(t.shape[0] <= 2 for n, t in stored.items() if "lora_A" in n)
    # a max rank above the merged rank changes nothing
    exact = merge(family["base"], family["adapters"], tmp_path / "x", output_format="lora", progress=False)
    loose = merge(family["base"], family["adapters"], tmp_path / "y", output_format="lora", max_rank=64, progress=False)
    assert loose["adapter"]["max_discarded_energy"] == 0.0
    assert exact["adapter"]["max_rank"] == loose["adapter"]["max_rank"]


def test_adapters_and_full_checkpoints_mix(family, tmp_path, capsys):
    base, adapters, dense, full = family["base"], family["adapters"], family["merged"], family["full"]
    keys = [*KEYS, "full"]
    for method in ("swudi_a", "ties"):
        merge(base, [*adapters, full], tmp_path / f"m-{method}", method=method, expert_keys=keys, progress=False)
        merge(base, [*dense, full], tmp_path / f"d-{method}", method=method, expert_keys=keys, progress=False)
        assert_same_model(weights(tmp_path / f"m-{method}"), weights(tmp_path / f"d-{method}"), 1e-4)
    out = tmp_path / "lora"
    assert main(["merge", str(base), *map(str, adapters), str(full), "-o", str(out), "--output-format", "lora"]) == 2
    assert "is a full checkpoint" in capsys.readouterr().err and not out.exists()


def test_bad_adapters_through_the_cli(family, tmp_path, capsys):
    root, base, good = family["root"], str(family["base"]), str(family["adapters"][0])
    other = save_adapter(None, tmp_path / "other", 1, config=llama_config(hidden=48), r=2, lora_alpha=4,
                         target_modules=["q_proj"])  # fmt: skip
    deeper = save_adapter(None, tmp_path / "deeper", 2, config=llama_config(layers=3), r=2, lora_alpha=4,
                          target_modules=["q_proj"])  # fmt: skip
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    (no_config / "adapter_model.safetensors").write_bytes(
        (family["adapters"][0] / "adapter_model.safetensors").read_bytes()
    )
    ia3 = tmp_path / "ia3"
    peft.get_peft_model(
        transformers.LlamaForCausalLM.from_pretrained(root / "base"),
        peft.IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
    ).save_pretrained(ia3)
    alora = save_adapter(root / "base", tmp_path / "alora", 3, r=2, lora_alpha=4, target_modules=["q_proj"])
    config = json.loads((alora / "adapter_config.json").read_text())
    (alora / "adapter_config.json").write_text(json.dumps({**config, "alora_invocation_tokens": [5, 9]}))
    cases = [
        (other, "trained on another base"),
        (deeper, "which the base model does not have"),
        (no_config, "no adapter_config.json"),
        (ia3, "PEFT type 'IA3' is not supported"),
        (alora, "the adapter is an activated LoRA"),
    ]
    capsys.readouterr()  # transformers' own progress output while building the cases
    for bad, message in cases:
        out = tmp_path / "out"
        assert main(["merge", base, good, str(bad), "-o", str(out), "-q"]) == 2, bad
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
        assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_gpt2_conv1d_adapters_round_trip(tmp_path):
    """fan_in_fan_out (Conv1D weights stored d_in x d_out): read, merged and written back in PEFT's layout."""
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32)
    torch.manual_seed(1)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "base")
    adapters = []
    for i, r in enumerate((2, 3)):
        model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "base")
        lora = {"r": r, "lora_alpha": 2 * r, "target_modules": ["c_attn", "c_fc"], "fan_in_fan_out": True}
        adapters.append(save_adapter(None, tmp_path / f"a{i}", 20 + i, model=model, **lora))
    merge(tmp_path / "base", adapters, tmp_path / "lora", output_format="lora", progress=False)
    merge(tmp_path / "base", adapters, tmp_path / "dense", progress=False)
    assert json.loads((tmp_path / "lora" / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    base_model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "base")
    with_adapter = peft.PeftModel.from_pretrained(base_model, tmp_path / "lora").eval()
    dense = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "dense").eval()
    expected = logits(dense)
    assert float((logits(with_adapter) - expected).abs().max()) <= 1e-4 * max(1.0, float(expected.abs().max()))
