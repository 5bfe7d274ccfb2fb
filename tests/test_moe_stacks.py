"""Fused MoE expert stacks (issue 48, item 4): a 3-D ``[E, ., .]`` stack is E linear layers, each merged with the
method asked for, in its architecture's orientation; never averaged behind the user's back.

gpt-oss stores its experts on disk as ``[E, in, out]``; transformers 5 holds Mixtral's as ``[E, out, in]`` in
memory. The reference is the registry method called on each expert's 2-D slice, oriented (out, in).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from quant_models import mxfp4_folder
from specmerge.io.formats.sources import open_source
from specmerge.methods import get_method
from specmerge.pipeline.run.api import merge
from specmerge.pipeline.run.memory import merge_state_dicts
from test_safety_inputs import cli_error

FAST = {"progress": False, "fsync": False}
STACK = "model.layers.0.mlp.experts.gate_up_proj"
DOWN = "model.layers.1.mlp.experts.down_proj"

if not hasattr(transformers, "GptOssForCausalLM"):
    pytest.skip("this transformers has no gpt-oss", allow_module_level=True)


def perturbed(state: dict, seed: int) -> dict:
    """A fine-tuned-like copy: rank-2 plus small noise on every floating tensor."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, value in state.items():
        if not value.is_floating_point():
            out[name] = value
            continue
        scale = 0.05 * float(value.std()) + 1e-3 if value.numel() > 1 else 1e-3
        delta = scale * torch.randn(value.shape, generator=g)
        if value.dim() >= 2:
            low = torch.randn(*value.shape[:-1], 2, generator=g) @ torch.randn(2, value.shape[-1], generator=g)
            delta = 0.2 * delta + scale * low / 2
        out[name] = value + delta
    return out


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> tuple[Path, list[Path]]:
    """A tiny gpt-oss base (2 layers, 4 experts of [in, out] slices; widths of 32, as MXFP4 needs) and two experts."""
    root = tmp_path_factory.mktemp("gpt_oss")
    config = transformers.GptOssConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=32, head_dim=8,
        layer_types=["full_attention", "full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config)
    model.save_pretrained(root / "base")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    experts = []
    for i in range(2):
        model.load_state_dict(perturbed(state, i + 1))
        model.save_pretrained(root / f"expert{i}")
        experts.append(root / f"expert{i}")
    return root / "base", experts


def per_slice(method: str, base: torch.Tensor, experts: list[torch.Tensor], name: str, *, in_out: bool) -> torch.Tensor:
    """Each expert slice e merged on its own: the method on the N task vectors of slice e, as (out, in)."""
    m = get_method(method)
    params = m.validate({}, len(experts))
    out = []
    for e in range(base.shape[0]):
        taus = torch.stack([(x[e] - base[e]) for x in experts]).float()
        if in_out:
            taus = taus.transpose(1, 2).contiguous()
        delta = m(taus, dtype=torch.float32, tensor_name=f"{name}[{e}]", **params).delta
        out.append(base[e] + (delta.T if in_out else delta))
    return torch.stack(out)


@pytest.mark.parametrize("method", ["swudi_a", "swudi", "tsv_m", "iso_c", "wudi", "ties", "task_arithmetic"])
def test_a_stack_on_disk_is_merged_as_its_experts_linear_layers(gpt_oss, tmp_path, method):
    base, experts = gpt_oss
    report = merge(base, experts, tmp_path / "out", method=method, dtype="float32", **FAST)
    merged = load_file(tmp_path / "out" / "model.safetensors")
    inputs = [load_file(p / "model.safetensors") for p in (base, *experts)]
    for name in (STACK, DOWN):
        want = per_slice(method, inputs[0][name], [x[name] for x in inputs[1:]], name, in_out=True)
        # the same float32 task vectors through the same method: the same numbers, to float32 rounding
        torch.testing.assert_close(merged[name], want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    reasons = {t["name"]: t["reason"] for t in report["tensors"]}
    assert reasons[STACK] == "expert stack (E linear layers)"
    assert reasons["model.layers.0.mlp.router.weight"] == "2-D linear weight"  # the router: a linear layer


def test_the_orientation_matters_to_a_spectral_method(gpt_oss):
    """Guard for the test above: merged as (in, out) the slices give another result, so it tells the two apart."""
    base, experts = gpt_oss
    inputs = [load_file(p / "model.safetensors") for p in (base, *experts)]
    args = ("swudi_a", inputs[0][STACK], [x[STACK] for x in inputs[1:]], STACK)
    right, wrong = per_slice(*args, in_out=True), per_slice(*args, in_out=False)
    assert float((right - wrong).norm() / (right - inputs[0][STACK]).norm()) > 0.01


def test_a_stack_of_an_unknown_layout_is_refused_by_matrix_methods(gpt_oss, tmp_path, capsys):
    base, experts = gpt_oss
    unknown = tmp_path / "base"
    unknown.mkdir()
    for f in base.iterdir():
        (unknown / f.name).write_bytes(f.read_bytes())
    config = json.loads((unknown / "config.json").read_text())
    config["model_type"] = "my_moe"
    (unknown / "config.json").write_text(json.dumps(config))
    args = ["merge", str(unknown), *map(str, experts), "-o", str(tmp_path / "out"), "-q"]
    err = cli_error([*args, "-m", "swudi_a"], capsys)
    assert "mlp.experts." in err and "stack of 4 experts' weights" in err and "action: average" in err, err
    assert not (tmp_path / "out").exists()
    merge(unknown, experts, tmp_path / "ta", method="ties", dtype="float32", **FAST)  # elementwise: per slice
    merged = load_file(tmp_path / "ta" / "model.safetensors")
    inputs = [load_file(p / "model.safetensors") for p in (base, *experts)]
    want = per_slice("ties", inputs[0][STACK], [x[STACK] for x in inputs[1:]], STACK, in_out=False)
    torch.testing.assert_close(merged[STACK], want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


def test_transformers_fused_stacks_in_memory_are_out_in():
    """A transformers-5 Mixtral holds its experts fused, [E, out, in]; the in-memory API merges them per slice."""
    config = transformers.MixtralConfig(
        hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        num_local_experts=3, vocab_size=32,
    )  # fmt: skip
    torch.manual_seed(0)
    base = transformers.MixtralForCausalLM(config)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    state = base.state_dict()
    if name not in state or state[name].dim() != 3:
        pytest.skip("this transformers keeps Mixtral's experts as 2-D weights")
    experts = [perturbed(state, seed) for seed in (1, 2)]
    merged = merge_state_dicts(base, experts, method="swudi_a", dtype="float32")
    want = per_slice("swudi_a", state[name], [x[name] for x in experts], name, in_out=False)
    torch.testing.assert_close(merged[name], want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


def test_mxfp4_stacks_read_as_transformers_dequantizes_them_and_merge_per_expert(gpt_oss, tmp_path):
    """gpt-oss as released: MXFP4 expert stacks. They read as transformers' own dequantizer gives them (where this
    transformers has it), and merging them is merging their dense values, slice by slice."""
    base, experts = gpt_oss
    quantized = [tmp_path / "q0", tmp_path / "q1"]
    dense = [mxfp4_folder(e, q) for e, q in zip(experts, quantized, strict=True)]
    with open_source(quantized[0]) as source:
        assert sorted(source.infos()) == sorted(dense[0])
        for name in (STACK, DOWN):
            torch.testing.assert_close(source.load(name), dense[0][name], rtol=0, atol=0)
            torch.testing.assert_close(source.load(name, (1, 3)), dense[0][name][1:3], rtol=0, atol=0)
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    stored = load_file(quantized[0] / "model.safetensors")
    if hasattr(mxfp4, "convert_moe_packed_tensors"):
        want = mxfp4.convert_moe_packed_tensors(
            stored[STACK + "_blocks"], stored[STACK + "_scales"], dtype=torch.float32
        )
        torch.testing.assert_close(dense[0][STACK], want, rtol=0, atol=0)
    merge(base, quantized, tmp_path / "out", method="swudi_a", dtype="float32", **FAST)
    merged = load_file(tmp_path / "out" / "model.safetensors")
    want = per_slice(
        "swudi_a", load_file(base / "model.safetensors")[STACK], [d[STACK] for d in dense], STACK, in_out=True
    )
    torch.testing.assert_close(merged[STACK], want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))


@pytest.mark.parametrize("method", ["swudi_a", "ties", "task_arithmetic"])
def test_lora_on_expert_stacks_merges_as_its_merge_and_unload_checkpoints(gpt_oss, tmp_path, method):
    """PEFT's target_parameters (LoRA on gpt-oss's expert stacks): each expert's rank-r update, merged per slice
    (factored where the method has a factored form), as the merge of the adapters' merge_and_unload checkpoints."""
    peft = pytest.importorskip("peft")
    base, _ = gpt_oss
    adapters, merged = [], []
    for seed in (1, 2):
        model = transformers.GptOssForCausalLM.from_pretrained(base, dtype=torch.float32)
        config = peft.LoraConfig(
            r=2, lora_alpha=4, target_modules=["q_proj"], init_lora_weights=False,
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        )  # fmt: skip
        wrapped = peft.get_peft_model(model, config)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for _, p in wrapped.named_parameters():
                if p.requires_grad:
                    p.add_(0.1 * float(p.std()) * torch.randn(p.shape, generator=g))
        wrapped.save_pretrained(tmp_path / f"lora{seed}")
        wrapped.merge_and_unload().save_pretrained(tmp_path / f"merged{seed}")
        adapters.append(tmp_path / f"lora{seed}")
        merged.append(tmp_path / f"merged{seed}")
    merge(base, adapters, tmp_path / "a", method=method, dtype="float32", **FAST)
    merge(base, merged, tmp_path / "b", method=method, dtype="float32", **FAST)
    got, want = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    base_stack = load_file(base / "model.safetensors")[STACK]
    assert not torch.equal(got[STACK], base_stack)  # the stack was changed (the test can tell)
    for name in want:
        scale = float(want[name].abs().max())
        # the factored route against the dense one, on deltas ~100x smaller than the weights: float32 rounding
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5 * scale, msg=name)


def test_a_seeded_method_draws_each_slice_as_its_own_layer():
    """DARE on a stack: slice e gets the masks of a 2-D tensor named '<name>[e]' (the merge of E separate layers,
    each seeded by its own name), not one mask over the whole stack."""
    from specmerge.io.views.task_vectors import Dense
    from specmerge.pipeline.plan.rules import TensorPlan
    from specmerge.pipeline.run.compute import merge_tensor

    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 8, 6, generator=g)
    experts = [base + 0.1 * torch.randn(3, 8, 6, generator=g) for _ in range(2)]
    params = get_method("dare_ties").validate({}, 2)
    entry = TensorPlan(STACK, (3, 8, 6), torch.float32, "merge", "dare_ties", params, "stack", True, True)
    options = {"device": torch.device("cpu"), "compute_dtype": torch.float32, "expert_keys": ["a", "b"]}
    whole, diagnostics = merge_tensor(entry, base, [Dense(x) for x in experts], **options)
    assert diagnostics["route"] == "stacked" and diagnostics["experts"] == 3
    for e in range(3):
        part = TensorPlan(f"{STACK}[{e}]", (8, 6), torch.float32, "merge", "dare_ties", params, "stack", True)
        alone, _ = merge_tensor(part, base[e], [Dense(x[e]) for x in experts], **options)
        torch.testing.assert_close(whole[e], alone, rtol=0, atol=0)
