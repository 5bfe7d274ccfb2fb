"""Tiny Hugging Face models with random weights, and "experts" made by perturbing them, saved to disk."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers


def llama_config(layers: int = 2, hidden: int = 32, positions: int = 64) -> transformers.LlamaConfig:
    """The tests' tiny Llama: ``layers`` decoder layers of width ``hidden``, 4 heads (2 KV), vocabulary 64."""
    return transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, max_position_embeddings=positions, tie_word_embeddings=False,
    )  # fmt: skip


def _configs() -> dict:
    return {
        "llama": (
            llama_config(),
            transformers.LlamaForCausalLM,
        ),
        "bert": (
            transformers.BertConfig(
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=48,
                vocab_size=64,
                max_position_embeddings=32,
            ),
            transformers.BertModel,
        ),
        "clip_vision": (
            transformers.CLIPVisionConfig(
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=2,
                num_attention_heads=4,
                image_size=16,
                patch_size=8,
            ),
            transformers.CLIPVisionModel,
        ),
    }


ARCHITECTURES = tuple(_configs())


def build_family(root: Path, arch: str, n_experts: int = 3, seed: int = 0) -> tuple[Path, list[Path]]:
    """Save a random base model and ``n_experts`` fine-tuned-like copies (low-rank + small noise deltas)."""
    config, cls = _configs()[arch]
    torch.manual_seed(seed)
    model = cls(config).eval()
    base = root / f"{arch}-base"
    model.save_pretrained(base)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    experts = []
    for i in range(n_experts):
        g = torch.Generator().manual_seed(seed * 100 + i + 1)
        perturbed = {}
        for name, value in state.items():
            if not value.is_floating_point():
                perturbed[name] = value
                continue
            scale = 0.05 * (float(value.std()) if value.numel() > 1 else 1.0) + 1e-3
            delta = scale * torch.randn(value.shape, generator=g)
            if value.dim() == 2:
                rank = 2
                low = torch.randn(value.shape[0], rank, generator=g) @ torch.randn(rank, value.shape[1], generator=g)
                delta = delta * 0.2 + scale * low / rank
            perturbed[name] = value + delta
        model.load_state_dict(perturbed)
        path = root / f"{arch}-expert{i}"
        model.save_pretrained(path)
        experts.append(path)
    model.load_state_dict(state)
    return base, experts


def dummy_inputs(arch: str) -> dict:
    if arch == "clip_vision":
        return {"pixel_values": torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))}
    return {"input_ids": torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))}


def random_lora(model, seed, *, std: float = 0.2, **lora):
    """``model`` wrapped by PEFT with a random LoRA adapter (B non-zero, entries N(0, std^2), seeded)."""
    import peft

    torch.manual_seed(seed)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **lora))
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.normal_(0, std)
    return wrapped


def save_adapter(base_dir, folder, seed, config=None, *, model=None, with_merged=False, **lora):
    """A random (non-zero B) PEFT LoRA adapter of ``model`` (default: the Llama in ``base_dir``, or a new one of
    ``config``); ``with_merged`` also saves its merge_and_unload model next to it (``<folder>-merged``)."""
    if model is None:
        model = (
            transformers.LlamaForCausalLM(config)
            if config
            else transformers.LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        )
    wrapped = random_lora(model, seed, **lora)
    wrapped.save_pretrained(folder)
    if with_merged:
        wrapped.merge_and_unload().save_pretrained(folder.parent / f"{folder.name}-merged")
    return folder


def poisoned_copy(model: Path, folder: Path, pick, index: int = 0, value: float = float("nan")) -> tuple[Path, str]:
    """A copy of the single-file model folder ``model`` in ``folder`` whose tensor chosen by ``pick`` (a name, or a
    predicate on names) holds ``value`` at flat ``index``; the copy and the tensor's name."""
    from safetensors.torch import load_file, save_file

    folder.mkdir()
    for file in model.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    name = pick if isinstance(pick, str) else next(n for n in tensors if pick(n))
    tensors[name].view(-1)[index] = value
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder, name


def expert_count(method, available: int) -> int:
    """How many of ``available`` experts to give a registered method: all, or the fewest its check asks for (slerp,
    nearswap, arcee_fusion: one, the base being the other model; nuslerp: two; passthrough, a copy of the base:
    none)."""
    for n in dict.fromkeys((available, 2, 1, 0)):
        try:
            method.validate({}, n)
            return n
        except ValueError:
            continue
    raise ValueError(f"method '{method.name}' takes none of {available}, 2, 1 or 0 experts")
