"""Tiny multimodal-style model sets built with transformers (random weights), saved to disk.

- :func:`build_llava_set`: a Llama base and experts that share its language model: Llava models (the base's
  language model fine-tuned, plus a CLIP vision tower and projector of their own) and a text-only Llama expert;
  the Llava experts' language models are also saved as plain Llama checkpoints, for reference merges.
- :func:`build_bert_set`: a ``BertModel`` base and ``BertForSequenceClassification`` experts (``bert.`` prefix,
  a classifier head of their own, with the numbers of labels asked for).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import transformers

from tiny_models import llama_config

IMAGE_TOKEN = 63  # the last id of the tiny Llama's vocabulary of 64 stands for an image patch


def vision_config() -> transformers.CLIPVisionConfig:
    """A tiny CLIP vision tower: 16x16 images in 8x8 patches (4 patches and a class token)."""
    return transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=8
    )


def llava_config() -> transformers.LlavaConfig:
    """A Llava of the tests' tiny Llama and :func:`vision_config`."""
    return transformers.LlavaConfig(
        vision_config=vision_config(), text_config=llama_config(), image_token_index=IMAGE_TOKEN
    )


def perturbed(state: Mapping[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """``state`` "fine-tuned": each floating tensor plus a small random delta (low-rank plus noise on matrices)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, value in state.items():
        if not value.is_floating_point():
            out[name] = value.clone()
            continue
        scale = 0.05 * (float(value.std()) if value.numel() > 1 else 1.0) + 1e-3
        delta = scale * torch.randn(value.shape, generator=g)
        if value.dim() == 2:
            low = torch.randn(value.shape[0], 2, generator=g) @ torch.randn(2, value.shape[1], generator=g)
            delta = 0.2 * delta + scale * low / 2
        out[name] = value + delta
    return out


def _llava_with(language: dict[str, torch.Tensor], seed: int) -> transformers.LlavaForConditionalGeneration:
    """A Llava whose language model (and lm_head) holds ``language`` (a LlamaForCausalLM state) and whose vision
    tower and projector are random (from ``seed``)."""
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(llava_config()).eval()
    model.model.language_model.load_state_dict(
        {k.removeprefix("model."): v for k, v in language.items() if k != "lm_head.weight"}
    )
    model.lm_head.load_state_dict({"weight": language["lm_head.weight"]})
    return model


def build_llava_set(root: Path, n_llava: int = 2, seed: int = 0) -> dict[str, Path]:
    """Save a Llama base and its experts under ``root``; return their folders by name.

    ``base``: LlamaForCausalLM. ``llava0`` ... : Llava experts (language model = base fine-tuned; own vision
    tower and projector). ``text``: a Llama expert. ``llava0-lm`` ...: each Llava expert's language model saved
    as a LlamaForCausalLM (the same tensors, for a reference merge of the language models alone).
    """
    torch.manual_seed(seed)
    base = transformers.LlamaForCausalLM(llama_config()).eval()
    paths = {"base": root / "base"}
    base.save_pretrained(paths["base"])
    state = {k: v.clone() for k, v in base.state_dict().items()}
    for i in range(n_llava):
        language = perturbed(state, seed * 100 + i + 1)
        _llava_with(language, seed * 100 + 50 + i).save_pretrained(root / f"llava{i}")
        base.load_state_dict(language)
        base.save_pretrained(root / f"llava{i}-lm")
        paths[f"llava{i}"], paths[f"llava{i}-lm"] = root / f"llava{i}", root / f"llava{i}-lm"
    base.load_state_dict(perturbed(state, seed * 100 + 99))
    base.save_pretrained(root / "text")
    paths["text"] = root / "text"
    return paths


def bert_config(num_labels: int = 2) -> transformers.BertConfig:
    """The tests' tiny BERT (as in tiny_models), with ``num_labels`` labels for a classification head."""
    return transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, vocab_size=64,
        max_position_embeddings=32, num_labels=num_labels,
    )  # fmt: skip


def build_bert_set(root: Path, labels: Sequence[int] = (2, 2), seed: int = 0) -> dict[str, Path]:
    """Save a BertModel base (``base``) and one BertForSequenceClassification expert per entry of ``labels``
    (``cls0``, ``cls1``, ...: the base fine-tuned, with a random head of that many labels); return the folders."""
    torch.manual_seed(seed)
    base = transformers.BertModel(bert_config(), add_pooling_layer=True).eval()
    paths = {"base": root / "base"}
    base.save_pretrained(paths["base"])
    state = base.state_dict()
    for i, n in enumerate(labels):
        torch.manual_seed(seed * 100 + 50 + i)
        expert = transformers.BertForSequenceClassification(bert_config(n)).eval()
        expert.bert.load_state_dict(perturbed(state, seed * 100 + i + 1))
        paths[f"cls{i}"] = root / f"cls{i}"
        expert.save_pretrained(paths[f"cls{i}"])
    return paths
