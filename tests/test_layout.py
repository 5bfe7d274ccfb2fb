"""Conv1D weights (GPT-2 family, stored (in, out)) are merged as (out, in): the layout table, the plan, the executor.

Matrix methods must see tau_i^T for a Conv1D weight and write the merged delta back transposed; the checks
compare the merged model with the registry method applied directly to the transposed (Linear-layout) deltas.
Both run the same float64 computation on the same inputs, so they agree up to float64 rounding, bounded by
:func:`tolerance`; the untransposed merge (what specmerge did before) differs by orders of magnitude more.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file

from specmerge.diagnostics.run import inspect_model
from specmerge.io.formats.layout import (
    CONV1D_LAYOUT,
    LayoutError,
    conv1d_modules,
    stored_in_out,
    transposed_weights,
)
from specmerge.io.formats.protocol import TensorInfo
from specmerge.io.views.task_vectors import LowRank
from specmerge.linalg.lowrank import LoraDelta
from specmerge.methods import get_method
from specmerge.pipeline.plan.rules import TensorPlan
from specmerge.pipeline.run.api import merge
from specmerge.pipeline.run.compute import merged_delta
from tiny_models import llama_config, save_adapter

EPS = torch.finfo(torch.float64).eps
MATRIX_METHODS = ("swudi_a", "swudi", "closed_form", "tsv_m", "iso_c")
# TSV-M and Iso-C treat U and V alike (per-task SVDs, orthogonalised; SVD of the sum with flat singular values):
# merge(tau^T) = merge(tau)^T, so the orientation changes only their rounding, not their result.
TRANSPOSE_EQUIVARIANT = frozenset({"tsv_m", "iso_c"})
CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
F64 = {"compute_dtype": "float64"}  # the models are float64 too: the output keeps their dtype


def gpt2_config(**extra) -> transformers.GPT2Config:
    # n_inner 80: c_fc is stored [32, 80], c_attn [32, 96], mlp.c_proj [80, 32], attn.c_proj [32, 32]
    return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_inner=80, vocab_size=64, n_positions=32, **extra)


def save_family(root, model: torch.nn.Module, n_experts: int = 3, seed: int = 0):
    """``model`` saved as the base, and experts = base + random rank-2 + small full-rank deltas on every weight."""
    model.save_pretrained(root / "base")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    experts = []
    for i in range(n_experts):
        g = torch.Generator().manual_seed(seed * 100 + i + 1)
        moved = {}
        for name, value in state.items():
            if not value.is_floating_point():
                moved[name] = value
                continue
            delta = 0.02 * torch.randn(value.shape, generator=g)
            if value.dim() == 2:
                delta += (
                    0.05 * torch.randn(value.shape[0], 2, generator=g) @ torch.randn(2, value.shape[1], generator=g)
                )
            moved[name] = value + delta
        model.load_state_dict(moved)
        model.save_pretrained(root / f"e{i}")
        experts.append(root / f"e{i}")
    model.load_state_dict(state)
    return root / "base", experts


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    torch.manual_seed(3)
    model = transformers.GPT2LMHeadModel(gpt2_config()).double().eval()
    return save_family(tmp_path_factory.mktemp("gpt2"), model)


def weights(folder) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def tolerance(stack: torch.Tensor) -> float:
    """Relative float64 perturbation bound of a spectral merge of ``stack`` (N x d_out x d_in).

    Two runs of the same float64 computation on the same inputs differ only by rounding (reduction order
    changes with the thread count): the eigen/singular vectors move by about d eps lambda_1 / gap, bounded
    here by d eps kappa, kappa = lambda_1 / (smallest eigenvalue of C = sum tau_i^T tau_i above d eps lambda_1).
    """
    gram = torch.einsum("nij,nik->jk", stack, stack)
    lam = torch.linalg.eigvalsh(gram).flip(0)
    d = max(stack.shape[1:])
    kept = lam[lam > d * EPS * lam[0]]
    return d * EPS * float(kept[0] / kept[-1])


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# ---------------------------------------------------------------------------------------------
# The layout table


def test_gpt2_conv1d_weights_are_marked_and_nothing_else(gpt2):
    base, _ = gpt2
    infos = {name: TensorInfo(name, tuple(t.shape), t.dtype) for name, t in weights(base).items()}
    marked = transposed_weights(base, infos)
    expected = {n for n in infos if n.endswith(CONV1D_SUFFIXES)}
    assert marked == expected and len(expected) == 8  # 4 per block, 2 blocks
    assert "transformer.h.0.mlp.c_fc.weight" in marked and infos["transformer.h.0.mlp.c_fc.weight"].shape == (32, 80)
    # biases, norms, embeddings are not 2-D Conv1D weights
    assert not any(n.endswith(("c_fc.bias", "ln_1.weight", "wte.weight", "wpe.weight")) for n in marked)
    # a single weights file has no config.json: nothing is transposed
    assert transposed_weights(base / "model.safetensors", infos) == frozenset()


def test_layout_table_by_model_type_architecture_and_composite():
    infos = {
        name: TensorInfo(name, shape, torch.float32)
        for name, shape in {
            "h.0.attn.c_attn.weight": (32, 96),  # the original GPT-2 checkpoints have no "transformer." prefix
            "h.0.crossattention.q_attn.weight": (32, 32),
            "h.0.mlp.c_proj.weight": (128, 32),
            "h.0.mlp.c_proj.bias": (32,),
            "model.layers.0.mlp.down_proj.weight": (32, 128),
        }.items()
    }
    gpt2 = {"h.0.attn.c_attn.weight", "h.0.crossattention.q_attn.weight", "h.0.mlp.c_proj.weight"}
    for model_type in ("gpt2", "gpt-sw3", "imagegpt", "decision_transformer"):
        assert stored_in_out({"model_type": model_type}, infos) == gpt2, model_type
    assert stored_in_out({"architectures": ["GPT2LMHeadModel"]}, infos) == gpt2  # no model_type
    assert stored_in_out({"model_type": "openai-gpt"}, infos) == gpt2 - {"h.0.crossattention.q_attn.weight"}
    assert stored_in_out({"model_type": "clvp"}, infos) == {"h.0.mlp.c_proj.weight"}
    for other in ({"model_type": "llama"}, {"model_type": "bert"}, {"architectures": ["LlamaForCausalLM"]}, {}, None):
        assert stored_in_out(other, infos) == frozenset(), other
    # a ViT encoder with a GPT-2 decoder: the decoder's Conv1D weights only
    composite = {
        "model_type": "vision-encoder-decoder",
        "encoder": {"model_type": "vit"},
        "decoder": {"model_type": "gpt2"},
    }
    names = {
        n: TensorInfo(n, (32, 96), torch.float32)
        for n in ("decoder.transformer.h.0.crossattention.c_attn.weight", "encoder.encoder.layer.0.attn.c_attn.weight")
    }
    assert stored_in_out(composite, names) == {"decoder.transformer.h.0.crossattention.c_attn.weight"}
    assert conv1d_modules(composite)[0][0] == "decoder."


def test_transformers_conv1d_is_stored_in_out():
    """The premise, checked on transformers itself: Conv1D(nf, nx) stores (nx, nf) = (in, out), y = x W + b."""
    layer = transformers.pytorch_utils.Conv1D(96, 32)
    x = torch.randn(5, 32)
    assert tuple(layer.weight.shape) == (32, 96)
    torch.testing.assert_close(layer(x), x @ layer.weight + layer.bias)


def test_unreadable_config_is_one_line_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(LayoutError, match=r"config\.json") as err:
        transposed_weights(tmp_path, {})
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------
# Whole-model merges


@pytest.mark.parametrize("method", MATRIX_METHODS)
def test_gpt2_merge_equals_the_merge_of_the_transposed_deltas(gpt2, tmp_path, method):
    base_dir, expert_dirs = gpt2
    report = merge(base_dir, expert_dirs, tmp_path / "m", method=method, progress=False, **F64)
    base, merged = weights(base_dir), weights(tmp_path / "m")
    experts = [weights(e) for e in expert_dirs]
    rows = {t["name"]: t for t in report["tensors"]}
    conv1d = [n for n in base if n.endswith(CONV1D_SUFFIXES)]
    assert len(conv1d) == 8
    for name in conv1d:
        stored = torch.stack([e[name].double() - base[name].double() for e in experts])  # N x d_in x d_out
        linear = stored.transpose(1, 2).contiguous()  # the Linear layout, N x d_out x d_in
        expected = get_method(method)(linear, tensor_name=name).delta.T
        got = merged[name].double() - base[name].double()
        # the method's own rounding, plus forming W_0 + delta and subtracting W_0 again (2 eps per entry)
        bound = tolerance(linear) + 2 * EPS * float(base[name].double().norm() / expected.norm())
        assert relative(got, expected) <= bound, name
        untransposed = get_method(method)(stored, tensor_name=name).delta  # what merging as stored gives
        if method in TRANSPOSE_EQUIVARIANT:
            assert relative(untransposed, expected) <= 2 * tolerance(linear), name
        else:
            assert relative(untransposed, expected) > 1e3 * bound, name
        assert rows[name]["diagnostics"]["layout"] == CONV1D_LAYOUT
    assert "layout" not in rows["transformer.h.0.ln_1.weight"]["diagnostics"]


def test_elementwise_methods_are_unaffected(gpt2, tmp_path):
    """Task arithmetic and TIES are elementwise: merged in the stored layout, as before (no "layout" reported)."""
    base_dir, expert_dirs = gpt2
    for method in ("task_arithmetic", "ties"):
        report = merge(base_dir, expert_dirs, tmp_path / method, method=method, progress=False, **F64)
        assert not any("layout" in t["diagnostics"] for t in report["tensors"])
        base, merged = weights(base_dir), weights(tmp_path / method)
        name = "transformer.h.1.mlp.c_fc.weight"
        stack = torch.stack([weights(e)[name] - base[name] for e in expert_dirs])
        expected = base[name] + get_method(method)(stack).delta
        # a few float64 roundings per entry (differences, sum, scale, + W_0), in whatever order the executor adds
        bound = 8 * EPS * (base[name].abs() + stack.abs().sum(0))
        assert bool(((merged[name] - expected).abs() <= bound).all()), method


def test_llama_is_unaffected(tmp_path):
    config = llama_config(layers=1, positions=32)
    torch.manual_seed(4)
    base_dir, expert_dirs = save_family(tmp_path, transformers.LlamaForCausalLM(config).double())
    report = merge(base_dir, expert_dirs, tmp_path / "m", method="swudi_a", progress=False, **F64)
    assert not any("layout" in t["diagnostics"] for t in report["tensors"])
    base, merged = weights(base_dir), weights(tmp_path / "m")
    name = "model.layers.0.mlp.up_proj.weight"  # stored (out, in) = (48, 32)
    stack = torch.stack([weights(e)[name].double() - base[name].double() for e in expert_dirs])
    expected = get_method("swudi_a")(stack).delta
    bound = tolerance(stack) + 2 * EPS * float(base[name].double().norm() / expected.norm())
    assert relative(merged[name].double() - base[name].double(), expected) <= bound


def test_inspect_reports_the_out_in_spectrum(gpt2, tmp_path):
    base_dir, expert_dirs = gpt2
    inspect_model(base_dir, expert_dirs, tmp_path / "r", progress=False, plots=False, wudi=False,
                  methods=("swudi_a",), layers="h.0.mlp", compute_dtype="float64")  # fmt: skip
    rows = {r["name"]: r for r in json.loads((tmp_path / "r" / "layers.json").read_text())}
    fc, proj = rows["transformer.h.0.mlp.c_fc.weight"], rows["transformer.h.0.mlp.c_proj.weight"]
    assert (fc["d_out"], fc["d_in"]) == (80, 32) and (proj["d_out"], proj["d_in"]) == (32, 80)
    assert fc["layout"] == CONV1D_LAYOUT
    # C = sum tau_i^T tau_i is d_in x d_in: full rank 32 for c_fc; at most N * d_out = 96 > 80 for c_proj
    assert fc["numerical_rank"] == 32 and proj["numerical_rank"] == 80


# ---------------------------------------------------------------------------------------------
# LoRA adapters of GPT-2 (PEFT's fan_in_fan_out)


@pytest.fixture(scope="module")
def gpt2_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt2_lora")
    torch.manual_seed(5)
    transformers.GPT2LMHeadModel(gpt2_config()).double().save_pretrained(root / "base")
    adapters, dense = [], []
    for i, r in enumerate((2, 3, 4)):
        model = transformers.GPT2LMHeadModel.from_pretrained(root / "base", dtype=torch.float64)
        lora = {"r": r, "lora_alpha": 2 * r, "target_modules": ["c_attn", "c_fc", "c_proj"], "fan_in_fan_out": True}
        adapters.append(save_adapter(None, root / f"a{i}", 30 + i, model=model, with_merged=True, **lora))
        dense.append(root / f"a{i}-merged")
    return root / "base", adapters, dense


def linear_layout_deltas(adapters, name: str) -> torch.Tensor:
    """s B A of every adapter for base weight ``name``, from PEFT's own factors: the (out, in) delta."""
    module = "base_model.model." + name.removesuffix(".weight")
    stack = []
    for folder in adapters:
        config = json.loads((folder / "adapter_config.json").read_text())
        factors = load_file(folder / "adapter_model.safetensors")
        B, A = factors[f"{module}.lora_B.weight"].double(), factors[f"{module}.lora_A.weight"].double()
        stack.append(config["lora_alpha"] / A.shape[0] * B @ A)
    return torch.stack(stack)


@pytest.mark.parametrize("method", ["swudi_a", "swudi"])
def test_gpt2_adapters_factored_and_dense_equal_the_out_in_merge(gpt2_adapters, tmp_path, method):
    base_dir, adapters, dense = gpt2_adapters
    factored = merge(base_dir, adapters, tmp_path / "f", method=method, progress=False, **F64)
    merge(base_dir, dense, tmp_path / "d", method=method, progress=False, **F64)
    base, from_adapters, from_dense = weights(base_dir), weights(tmp_path / "f"), weights(tmp_path / "d")
    rows = {t["name"]: t["diagnostics"] for t in factored["tensors"]}
    for name in [n for n in base if n.endswith(CONV1D_SUFFIXES)]:
        assert rows[name]["route"] == "factored" and rows[name]["layout"] == CONV1D_LAYOUT
        linear = linear_layout_deltas(adapters, name)
        expected = get_method(method)(linear, tensor_name=name).delta.T  # back to the stored (in, out)
        bound = tolerance(linear) + 2 * EPS * float(base[name].norm() / expected.norm())
        assert relative(from_adapters[name].double() - base[name].double(), expected) <= bound, name
        assert relative(from_dense[name].double() - base[name].double(), expected) <= bound, name
        untransposed = get_method(method)(linear.transpose(1, 2).contiguous(), tensor_name=name).delta
        assert relative(untransposed, expected) > 1e3 * bound, name


def test_factored_route_transposes_low_rank_deltas():
    """merged_delta on a transposed entry: a LoraDelta in the stored layout is merged as (s B A) in (out, in)."""
    g = torch.Generator().manual_seed(1)
    f64 = {"generator": g, "dtype": torch.float64}
    linear = [LoraDelta(torch.randn(12, 2, **f64), torch.randn(2, 7, **f64), 0.5) for _ in range(3)]
    stored = [LowRank(d).transposed() for d in linear]  # what AdapterExpert gives for fan_in_fan_out: (in, out)
    assert stored[0].delta.shape == (7, 12)
    entry = TensorPlan("h.0.mlp.c_fc.weight", (7, 12), torch.float64, "merge", "swudi_a", {}, "2-D", transposed=True)
    delta, diagnostics = merged_delta(entry, None, stored, device=torch.device("cpu"), compute_dtype=torch.float64)
    assert diagnostics["route"] == "factored" and diagnostics["layout"] == CONV1D_LAYOUT
    dense = torch.stack([d.dense() for d in linear])
    expected = get_method("swudi_a")(dense).delta.T
    assert relative(delta.dense(), expected) <= tolerance(dense)
