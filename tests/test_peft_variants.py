"""PEFT variants as experts (issue 48, item 5): DoRA, LoRA biases, modules_to_save, trainable tokens and LoRA on
embeddings merge as PEFT's merge_and_unload makes them; what cannot become a LoRA adapter is refused in one line."""

from __future__ import annotations

from pathlib import Path

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file

from specmerge.errors import SpecmergeError
from specmerge.pipeline.run.api import merge
from tiny_models import llama_config

FAST = {"progress": False, "fsync": False}
VARIANTS = {
    "dora": {"target_modules": ["q_proj", "v_proj", "down_proj"], "use_dora": True},
    "lora_bias": {"target_modules": ["q_proj", "k_proj"], "lora_bias": True},
    "modules_to_save": {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]},
    "trainable_tokens": {"target_modules": ["q_proj"], "trainable_token_indices": [3, 5, 60]},
    "embedding_lora": {"target_modules": ["q_proj", "embed_tokens"]},
    "dora_saved_and_tokens": {  # PEFT does not combine DoRA with lora_bias
        "target_modules": ["q_proj", "o_proj"], "use_dora": True, "modules_to_save": ["lm_head"],
        "trainable_token_indices": [7],
    },
}  # fmt: skip


def base_model() -> transformers.LlamaForCausalLM:
    config = llama_config()
    config.attention_bias = True  # biases for lora_bias to change
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("variants") / "base"
    base_model().save_pretrained(folder)
    return folder


def trained_adapter(base: Path, folder: Path, seed: int, **config) -> tuple[Path, Path]:
    """A PEFT adapter of ``config`` with every trainable tensor moved off its initial value (a stand-in for
    training), saved; and its merge_and_unload model beside it."""
    model = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, lora_alpha=4, init_lora_weights=False, **config))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in wrapped.named_parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn(p.shape, generator=g) * (float(p.std()) if p.numel() > 1 else 1.0))
    wrapped.save_pretrained(folder)
    merged = folder.parent / f"{folder.name}-merged"
    wrapped.merge_and_unload().save_pretrained(merged)
    return folder, merged


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("method", ["task_arithmetic", "swudi_a"])
def test_a_variant_adapter_merges_as_its_merge_and_unload_checkpoint(base, tmp_path, variant, method):
    adapter, merged = trained_adapter(base, tmp_path / "adapter", 1, **VARIANTS[variant])
    other, _ = trained_adapter(base, tmp_path / "other", 2, target_modules=["q_proj", "v_proj", "down_proj"])
    merge(base, [adapter, other], tmp_path / "a", method=method, dtype="float32", **FAST)
    merge(base, [merged, other], tmp_path / "b", method=method, dtype="float32", **FAST)
    got, want = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        # PEFT merges in float32 with its own order of operations (DoRA's norm through a forward of the identity):
        # the same numbers to float32 rounding, relative to the tensor's size
        scale = float(want[name].abs().max())
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5 * scale, msg=f"{variant}: {name}")
    changed = {
        "dora": "model.layers.0.self_attn.q_proj.weight",
        "lora_bias": "model.layers.0.self_attn.q_proj.bias",
        "modules_to_save": "lm_head.weight",
        "trainable_tokens": "model.embed_tokens.weight",
        "embedding_lora": "model.embed_tokens.weight",
        "dora_saved_and_tokens": "model.layers.1.self_attn.o_proj.weight",
    }[variant]
    base_tensor = load_file(base / "model.safetensors")[changed]
    assert not torch.equal(got[changed], base_tensor)  # the variant did change it (the test can tell)


@pytest.mark.parametrize("variant", ["dora", "lora_bias", "modules_to_save", "trainable_tokens"])
def test_variants_that_are_not_lora_deltas_cannot_be_written_as_an_adapter(base, tmp_path, variant):
    adapter, _ = trained_adapter(base, tmp_path / "adapter", 1, **VARIANTS[variant])
    other, _ = trained_adapter(base, tmp_path / "other", 2, target_modules=["q_proj"])
    with pytest.raises(SpecmergeError, match=r"cannot be written as a LoRA adapter: write a merged model") as err:
        merge(base, [adapter, other], tmp_path / "out", method="task_arithmetic", output_format="lora", **FAST)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_a_lora_on_embeddings_is_merged_exactly_in_factored_form(base, tmp_path):
    """Two embedding LoRAs merged as an adapter (task arithmetic, exact): its merge_and_unload is the dense merge."""
    one, merged_one = trained_adapter(base, tmp_path / "one", 1, **VARIANTS["embedding_lora"])
    two, merged_two = trained_adapter(base, tmp_path / "two", 2, **VARIANTS["embedding_lora"])
    options = {"method": "task_arithmetic", "merge_embeddings": True, **FAST}  # the embedding gets the method
    merge(base, [one, two], tmp_path / "lora", output_format="lora", **options)
    merge(base, [merged_one, merged_two], tmp_path / "dense", **options)
    model = peft.PeftModel.from_pretrained(
        transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32), tmp_path / "lora"
    ).merge_and_unload()
    want = load_file(tmp_path / "dense" / "model.safetensors")["model.embed_tokens.weight"]
    got = model.state_dict()["model.embed_tokens.weight"]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
