"""The in-memory API (issue 16): state dicts, modules and PEFT models merged in memory give the folder API's bits.

Every equality here is bitwise (``torch.equal`` and the same dtype) against ``specmerge.merge`` run on the same
weights saved to disk, with torch's thread count pinned to 1 so that both runs reduce in the same order.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

import specmerge
from specmerge.errors import RecipeError, SpecmergeError
from specmerge.io.formats.protocol import SourceError
from specmerge.io.views.memory import MemorySource
from tiny_models import build_family, llama_config, random_lora

OVERRIDES = [{"pattern": "*.mlp.*", "action": "average"}, {"pattern": "model.layers.0.*", "action": "keep_base"}]
CASES = {
    "swudi_a": ("swudi_a", {}, {}),
    "task_arithmetic": ("task_arithmetic", {"scale": 0.7}, {}),
    "ties": ("ties", {"density": 0.3}, {}),
    "dare_ties": ("dare_ties", {}, {}),
    "tsv_m": ("tsv_m", {}, {}),
    "average and keep_base overrides": ("swudi_a", {}, {"overrides": OVERRIDES}),
    "dtype float16, float64 compute": ("ties", {}, {"dtype": "float16", "compute_dtype": "float64"}),
    "expert weights": ("task_arithmetic", {}, {"expert_weights": [0.5, 0.2, 0.3]}),
}


@pytest.fixture(autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def folder_weights(folder) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def assert_bitwise(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


def folder_merge(tmp_path, base, experts, name="out", **options) -> dict[str, torch.Tensor]:
    out = tmp_path / name
    specmerge.merge(base, experts, out, progress=False, **options)
    return folder_weights(out)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("memory")
    base, experts = build_family(root, "llama", n_experts=3)
    return {
        "root": root,
        "base": base,
        "experts": experts,
        "base_sd": load_file(base / "model.safetensors"),
        "expert_sds": [load_file(e / "model.safetensors") for e in experts],
    }


@pytest.mark.parametrize("case", list(CASES))
def test_state_dicts_give_the_folder_apis_bits(family, tmp_path, case):
    method, params, options = CASES[case]
    expected = folder_merge(tmp_path, family["base"], family["experts"], method=method, params=params, **options)
    got = specmerge.merge_state_dicts(family["base_sd"], family["expert_sds"], method=method, params=params, **options)
    assert list(got) == list(family["base_sd"])  # the base's order
    assert_bitwise(got, expected)


def test_bfloat16_base_with_float32_experts(family, tmp_path):
    base_bf16 = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in family["base_sd"].items()}
    save_file(base_bf16, tmp_path / "base-bf16.safetensors")
    expected = folder_merge(tmp_path, tmp_path / "base-bf16.safetensors", family["experts"], method="ties")
    got = specmerge.merge_state_dicts(base_bf16, family["expert_sds"], method="ties")
    assert all(t.dtype == torch.bfloat16 for t in got.values() if t.is_floating_point())
    assert_bitwise(got, expected)


def test_row_blocks_are_assembled(tmp_path):
    """A tensor over the executor's 16 MiB block is merged (linear methods) block by block into one tensor."""
    g = torch.Generator().manual_seed(3)
    base = {"big.weight": torch.randn(2100, 2048, generator=g), "big.bias": torch.randn(2100, generator=g)}
    experts = [{k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in range(2)]
    for name, sd in [("base", base), ("e0", experts[0]), ("e1", experts[1])]:
        save_file(sd, tmp_path / f"{name}.safetensors")
    expected = folder_merge(tmp_path, tmp_path / "base.safetensors", [tmp_path / "e0.safetensors",
                            tmp_path / "e1.safetensors"], method="task_arithmetic")  # fmt: skip
    assert_bitwise(specmerge.merge_state_dicts(base, experts, method="task_arithmetic"), expected)


def test_modules_in_and_out(family, tmp_path):
    load = transformers.LlamaForCausalLM.from_pretrained
    base, experts = load(family["base"]), [load(e) for e in family["experts"]]
    before = {k: v.clone() for k, v in base.state_dict().items()}
    expected = folder_merge(tmp_path, family["base"], family["experts"], method="swudi_a", dtype="bfloat16")
    merged = specmerge.merge_modules(base, experts, method="swudi_a", dtype="bfloat16")
    assert merged is not base and type(merged) is type(base)
    assert_bitwise(merged.state_dict(), expected)
    assert_bitwise(specmerge.merge_state_dicts(base, experts, method="swudi_a", dtype="bfloat16"), expected)
    assert_bitwise(base.state_dict(), before)  # the base module is untouched, still float32
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(0))
    assert merged(ids).logits.dtype == torch.bfloat16


def test_inputs_are_not_modified(family):
    """Non-contiguous and requires_grad tensors, merged by every route (keep_base, linear, dense, factored)."""
    base = {k: v.t().contiguous().t() if v.dim() == 2 else v.clone() for k, v in family["base_sd"].items()}
    base = {k: v.requires_grad_() if v.is_floating_point() else v for k, v in base.items()}
    experts = [dict(e) for e in family["expert_sds"]]
    inputs = [base, *experts]
    clones = [{k: v.detach().clone() for k, v in sd.items()} for sd in inputs]
    marks = [{k: (v.data_ptr(), v._version, v.stride()) for k, v in sd.items()} for sd in inputs]
    keys = [list(sd) for sd in inputs]
    for method, options in [("task_arithmetic", {}), ("swudi_a", {"overrides": OVERRIDES}), ("ties", {})]:
        merged = specmerge.merge_state_dicts(base, experts, method=method, **options)
        for tensor in merged.values():  # new tensors, none of them the caller's memory, none needing grad
            assert not tensor.requires_grad
            assert all(tensor.untyped_storage().data_ptr() != v.untyped_storage().data_ptr() for v in base.values())
    for sd, clone, mark, names in zip(inputs, clones, marks, keys, strict=True):
        assert list(sd) == names
        assert {k: (v.data_ptr(), v._version, v.stride()) for k, v in sd.items()} == mark
        assert_bitwise({k: v.detach() for k, v in sd.items()}, clone)


def save_perturbed(base, folder, scale, *, seed, n=2):
    """``n`` copies of module ``base``, every parameter moved by ``scale`` N(0, 1) noise (seeded; a tied parameter is
    listed once, so it stays tied), saved as ``folder/e<i>``."""
    experts = []
    for i in range(n):
        expert = copy.deepcopy(base)
        with torch.no_grad():
            for k, p in enumerate(expert.parameters()):
                p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed + 1000 * i + k)))
        expert.save_pretrained(folder / f"e{i}")
        experts.append(expert)
    return experts


def lora_model(base_dir, folder, seed, **lora):
    """A PEFT model of the Llama in ``base_dir`` with a random (non-zero) LoRA adapter, saved to ``folder``."""
    model = transformers.LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    wrapped = random_lora(model, seed, **lora)
    wrapped.save_pretrained(folder)
    return wrapped


@pytest.fixture(scope="module")
def adapters(family):
    root = family["root"]
    return [
        lora_model(family["base"], root / "a0", 10, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]),
        lora_model(family["base"], root / "a1", 11, r=2, lora_alpha=4, target_modules=["q_proj", "up_proj"],
                   use_rslora=True),
    ]  # fmt: skip


@pytest.mark.parametrize("full", [False, True], ids=["adapters", "adapters and a full expert"])
@pytest.mark.parametrize("method", ["swudi_a", "task_arithmetic", "ties"])  # factored, factored, densified
def test_peft_models_give_the_adapter_folders_bits(family, adapters, tmp_path, method, full):
    root = family["root"]
    folders = [root / "a0", root / "a1", *family["experts"][:full]]
    expected = folder_merge(tmp_path, family["base"], folders, method=method)
    base = dict(family["base_sd"])
    clone = {k: v.clone() for k, v in base.items()}
    lora = [{k: v.detach().clone() for k, v in a.state_dict().items() if "lora_" in k} for a in adapters]
    got = specmerge.merge_state_dicts(base, [*adapters, *family["expert_sds"][:full]], method=method)
    assert_bitwise(got, expected)
    assert_bitwise(base, clone)  # the factored route adds B A into a copy of the base, never the caller's
    for a, before in zip(adapters, lora, strict=True):
        assert_bitwise({k: v for k, v in a.state_dict().items() if "lora_" in k}, before)


def test_a_base_wrapped_by_peft_is_its_weights_under_the_adapters(family, adapters, tmp_path):
    expected = folder_merge(tmp_path, family["base"], [family["root"] / "a0"], method="task_arithmetic")
    for base in (adapters[1], adapters[1].get_base_model()):  # the PeftModel, and the model it wrapped in place
        assert_bitwise(specmerge.merge_state_dicts(base, [adapters[0]], method="task_arithmetic"), expected)
    with pytest.raises(RecipeError, match=r"holds PEFT tensors .*lora_"):
        specmerge.merge_modules(adapters[1].get_base_model(), [adapters[0]])
    with pytest.raises(SourceError, match=r"expert 'expert0' holds PEFT tensors .*pass the PeftModel itself"):
        specmerge.merge_state_dicts(family["base_sd"], [adapters[0].get_base_model()])


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A tiny Llama with tied embeddings and two experts that keep the tie, saved (the tie stored once)."""
    root = tmp_path_factory.mktemp("tied")
    config = copy.deepcopy(llama_config())
    config.tie_word_embeddings = True
    torch.manual_seed(1)
    base = transformers.LlamaForCausalLM(config)
    base.save_pretrained(root / "base")
    experts = save_perturbed(base, root, 0.01, seed=0)
    return root, base, experts


def test_tied_weights_are_one_tensor(tied, tmp_path):
    root, base, experts = tied
    assert base.lm_head.weight is base.model.embed_tokens.weight
    expected = folder_merge(tmp_path, root / "base", [root / "e0", root / "e1"], method="swudi_a")
    assert "lm_head.weight" not in expected  # Hugging Face stores the pair once
    got = specmerge.merge_state_dicts(base, experts, method="swudi_a")
    assert got["lm_head.weight"] is got["model.embed_tokens.weight"]
    assert_bitwise({k: v for k, v in got.items() if k != "lm_head.weight"}, expected)
    merged = specmerge.merge_modules(base, experts, method="swudi_a")
    assert merged.lm_head.weight is merged.model.embed_tokens.weight  # still tied
    assert torch.equal(merged.lm_head.weight, expected["model.embed_tokens.weight"])
    untied = dict(experts[0].state_dict())
    untied["lm_head.weight"] = untied["lm_head.weight"].clone()
    with pytest.raises(SpecmergeError, match=r"^tensor 'lm_head.weight' is tied to 'model.embed_tokens.weight' in "
                       "the base but not in expert 'b'"):  # fmt: skip
        specmerge.merge_state_dicts(base, [experts[1], untied], expert_keys=["a", "b"])


def test_mismatched_names_and_shapes_are_the_plans_one_line_errors(family):
    base, expert = family["base_sd"], family["expert_sds"][0]
    name = "model.layers.1.mlp.up_proj.weight"
    cases = [
        ({**expert, "extra.weight": torch.zeros(2)}, r"tensor 'extra.weight' is in expert 'math' but not in the base"),
        ({k: v for k, v in expert.items() if k != name}, rf"tensor '{name}' is in the base but not in expert 'math'"),
        ({**expert, name: expert[name][:, :-1]}, rf"tensor '{name}' has shape \(48, 31\) in expert 'math' but"),
    ]
    for broken, message in cases:
        with pytest.raises(SpecmergeError, match=message) as err:
            specmerge.merge_state_dicts(base, [broken], expert_keys=["math"])
        assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"shard_size": "1GB"}, "option 'shard_size' does not apply to an in-memory merge"),
        ({"output_format": "lora"}, "option 'output_format' does not apply to an in-memory merge"),
        ({"tokenizer_source": "base"}, "option 'tokenizer_source' does not apply"),
        ({"non_matrx": "average"}, "unknown recipe key 'non_matrx': did you mean 'non_matrix'"),
        ({"method": "swudi_a", "params": {"rule": "nope"}}, "rule"),
        ({"expert_keys": ["a", "b"]}, "expert_keys has 2 names but there are 1 experts"),
    ],
)
def test_options_are_validated_before_any_tensor_is_read(family, arguments, message):
    poisoned = {"x": torch.tensor([float("nan")])}  # never read: validation comes first
    with pytest.raises(RecipeError, match=message) as err:
        specmerge.merge_state_dicts(poisoned, [poisoned], **arguments)
    assert "\n" not in str(err.value)


def test_inputs_of_the_wrong_kind(family, tmp_path):
    base, expert = family["base_sd"], family["expert_sds"][0]
    with pytest.raises(RecipeError, match=r"experts must be a list .*pass \[expert\] for one expert"):
        specmerge.merge_state_dicts(base, expert)
    with pytest.raises(RecipeError, match=r"the base is a path .*specmerge\.merge"):
        specmerge.merge_state_dicts(str(family["base"]), [expert])
    with pytest.raises(SourceError, match=r"'model\.norm\.weight' is a list, not a torch\.Tensor"):
        specmerge.merge_state_dicts(base, [{**expert, "model.norm.weight": [1.0]}])
    with pytest.raises(SourceError, match="on the meta device"):
        specmerge.merge_state_dicts(base, [{**expert, "model.norm.weight": torch.empty(32, device="meta")}])


def test_memory_source_reads_copies():
    """The TensorSource: infos without copying, rows, copies on the CPU, the folder readers' missing-name error."""
    weight = torch.arange(12.0).reshape(3, 4).t()  # non-contiguous
    source = MemorySource({"w": weight, "alias": weight, "n": torch.tensor(3)}, "base")
    assert source.aliases == {"alias": "w"}
    assert [(i.name, i.shape, i.dtype) for i in source.infos().values()] == [
        ("w", (4, 3), torch.float32),
        ("n", (), torch.int64),
    ]
    rows = source.load("w", (1, 3))
    assert rows.is_contiguous() and torch.equal(rows, weight[1:3])
    assert rows.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
    with pytest.raises(SourceError, match="no tensor named 'ww'; did you mean 'w'"):
        source.load("ww")
    with pytest.raises(SourceError, match="rows \\(2, 9\\) out of range for tensor 'w'"):
        source.load("w", (2, 9))


def test_a_base_modules_config_gives_the_conv1d_layout(tmp_path):
    """GPT-2's Conv1D weights are merged as (out, in), as from a folder with config.json; a bare state dict has no
    config, so (like a single weights file) its weights are merged as stored, which changes SWUDI-A's result."""
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=32)
    torch.manual_seed(2)
    base = transformers.GPT2Model(config)
    base.save_pretrained(tmp_path / "base")
    experts = save_perturbed(base, tmp_path, 0.02, seed=10)
    expected = folder_merge(tmp_path, tmp_path / "base", [tmp_path / "e0", tmp_path / "e1"], method="swudi_a")
    assert_bitwise(specmerge.merge_state_dicts(base, experts, method="swudi_a"), expected)
    bare = specmerge.merge_state_dicts(base.state_dict(), [e.state_dict() for e in experts], method="swudi_a")
    assert not torch.equal(bare["h.0.attn.c_attn.weight"], expected["h.0.attn.c_attn.weight"])
