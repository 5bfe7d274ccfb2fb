"""PEFT LoRA adapters read as low-rank deltas, checked against PEFT's own merge_and_unload."""

import json

import peft
import pytest
import torch
import transformers

from specmerge import get_method
from specmerge.io.formats.peft import AdapterError, is_adapter, open_adapter
from specmerge.io.formats.sources import open_source
from tiny_models import random_lora


def tiny_llama(seed=0, hidden=32):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def make_adapter(model_fn, folder, seed, **lora):
    """Save a randomly initialised (non-zero B) adapter and return PEFT's merged state dict."""
    wrapped = random_lora(model_fn(), seed, std=0.1, **lora)
    wrapped.save_pretrained(folder)
    return {k: v.clone() for k, v in wrapped.merge_and_unload().state_dict().items()}


LLAMA_CASES = [
    {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"], "use_rslora": True},
    {
        "r": 4,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "o_proj", "up_proj"],
        "rank_pattern": {"up_proj": 2},
        "alpha_pattern": {"o_proj": 4},
    },
]


@pytest.mark.parametrize("lora", LLAMA_CASES)
def test_deltas_equal_peft_merge_and_unload(tmp_path, lora):
    base = tiny_llama().state_dict()
    merged = make_adapter(tiny_llama, tmp_path / "a", seed=1, **lora)
    assert is_adapter(tmp_path / "a")
    with open_adapter(tmp_path / "a") as adapter:
        adapter.check_base({k: _info(k, v) for k, v in base.items()})
        modules = adapter.modules()
        assert modules and all(m.shape == tuple(base[n].shape) for n, m in modules.items())
        for name in base:
            if name in modules:
                torch.testing.assert_close(base[name] + adapter.load(name).dense(), merged[name], rtol=1e-5, atol=1e-6)
            else:
                torch.testing.assert_close(base[name], merged[name])
        if "rank_pattern" in lora:
            up = next(m for n, m in modules.items() if n.endswith("up_proj.weight"))
            o = next(m for n, m in modules.items() if n.endswith("o_proj.weight"))
            assert up.rank == 2 and o.alpha == 4


def test_gpt2_conv1d_fan_in_fan_out(tmp_path):
    def gpt2():
        torch.manual_seed(0)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64))

    base = gpt2().state_dict()
    merged = make_adapter(
        gpt2, tmp_path / "g", seed=2, r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True
    )
    with open_adapter(tmp_path / "g") as adapter:
        (name,) = adapter.modules()
        assert adapter.modules()[name].transposed and base[name].shape == (32, 96)
        torch.testing.assert_close(base[name] + adapter.load(name).dense(), merged[name], rtol=1e-5, atol=1e-6)


def test_factored_merge_of_adapters_equals_dense_merge_of_merged_models(tmp_path):
    base = tiny_llama().state_dict()
    lora = {"target_modules": ["q_proj", "v_proj", "down_proj"], "lora_alpha": 8}
    merged = [make_adapter(tiny_llama, tmp_path / f"a{i}", seed=i + 1, r=2 + 2 * i, **lora) for i in range(3)]
    adapters = [open_adapter(tmp_path / f"a{i}") for i in range(3)]
    for name in adapters[0].modules():
        # The merged checkpoints are float32: W_i - W_0 is s B A plus rounding noise of relative size eps32 in
        # every direction. SWUDI (gain <= t) and SWUDI-A (K leading directions) are insensitive to it, but the
        # pseudo-inverse of closed_form inverts the noise directions by 1 / lambda, so for it the comparison is
        # well posed only on the exact low-rank deltas (s B A formed in float64).
        rounded = torch.stack([m[name] - base[name] for m in merged]).double()
        exact = torch.stack([a.load(name).to(torch.device("cpu"), torch.float64).dense() for a in adapters])
        for method in ("swudi_a", "swudi", "closed_form"):
            dense = get_method(method)(exact if method == "closed_form" else rounded).delta
            factored = get_method(method).merge_factored([a.load(name) for a in adapters], dtype=torch.float64).dense()
            assert float((factored - dense).norm() / dense.norm()) < 1e-4, (name, method)


def _info(name, tensor):
    from specmerge.io.formats.protocol import TensorInfo

    return TensorInfo(name, tuple(tensor.shape), tensor.dtype)


def test_bad_adapters_are_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterError, match=r"no adapter_config\.json"):
        open_adapter(tmp_path / "empty")

    model = tiny_llama()
    peft.get_peft_model(
        model, peft.IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])
    ).save_pretrained(tmp_path / "ia3")
    with pytest.raises(AdapterError, match="PEFT type 'IA3' is not supported"):
        open_adapter(tmp_path / "ia3")

    make_adapter(tiny_llama, tmp_path / "dora", seed=3, r=2, lora_alpha=4, target_modules=["q_proj"], use_dora=True)
    with open_adapter(tmp_path / "dora") as dora:  # read since issue 48 (tests/test_peft_variants.py)
        assert list(dora.variants.magnitude) == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]

    # an adapter trained on another base: shapes do not match
    make_adapter(
        lambda: tiny_llama(hidden=48), tmp_path / "other", seed=4, r=2, lora_alpha=4, target_modules=["q_proj"]
    )
    base = {k: _info(k, v) for k, v in tiny_llama().state_dict().items()}
    with open_adapter(tmp_path / "other") as adapter, pytest.raises(AdapterError, match="trained on another base"):
        adapter.check_base(base)

    # a target module the base does not have
    make_adapter(tiny_llama, tmp_path / "a", seed=5, r=2, lora_alpha=4, target_modules=["q_proj"])
    renamed = {k.replace("q_proj", "query"): v for k, v in base.items()}
    with open_adapter(tmp_path / "a") as adapter, pytest.raises(AdapterError, match="does not have"):
        adapter.check_base(renamed)
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA"
    with open_source(tmp_path / "a" / "adapter_model.safetensors") as weights:
        assert all(".lora_" in n for n in weights.infos())


@pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers`")
def test_lora_on_embeddings_is_read_as_the_embedding_delta(tmp_path):
    """PEFT's lora_embedding_A [r, vocab] and lora_embedding_B [dim, r]: the embedding's delta is s (B A)^T."""
    make_adapter(tiny_llama, tmp_path / "emb", seed=6, r=2, lora_alpha=4, target_modules=["embed_tokens", "q_proj"])
    with open_adapter(tmp_path / "emb") as adapter:
        delta = adapter.load("model.embed_tokens.weight")
        A = adapter.load_stored("base_model.model.model.embed_tokens.lora_embedding_A")
        B = adapter.load_stored("base_model.model.model.embed_tokens.lora_embedding_B")
        torch.testing.assert_close(delta.dense(), 2.0 * (B @ A).T)  # scale = lora_alpha / r = 2
