"""Build two tiny model sets whose experts carry modules the base lacks (random weights, built with transformers).

    python examples/modality_merging.py WORKDIR

writes

- ``WORKDIR/base``: a 2-layer Llama (``LlamaForCausalLM``), the shared language model;
- ``WORKDIR/vision``: a Llava (``LlavaForConditionalGeneration``) whose language model is the base fine-tuned
  (perturbed), with a CLIP vision tower and a projector of its own; transformers saves its language model as
  ``language_model.model.*`` and ``language_model.lm_head.weight``;
- ``WORKDIR/text``: the base fine-tuned, a plain Llama;
- ``WORKDIR/bert``: a ``BertModel``; ``WORKDIR/sst2`` and ``WORKDIR/nli``: ``BertForSequenceClassification``
  experts of it (``bert.*`` names) with classifier heads of 2 and 3 labels.

Merge them as in the README, "Modality merging and experts with their own modules / heads":
``specmerge merge WORKDIR/base WORKDIR/vision WORKDIR/text -o WORKDIR/omni --config-source vision``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers


def llama_config() -> transformers.LlamaConfig:
    """A 2-layer Llama of width 32 with a vocabulary of 64 rows (id 63 stands for an image patch in the Llava)."""
    return transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip


def bert_config(num_labels: int = 2) -> transformers.BertConfig:
    return transformers.BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, vocab_size=64,
        max_position_embeddings=32, num_labels=num_labels,
    )  # fmt: skip


def fine_tuned(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A stand-in for fine-tuning: every floating tensor plus 5 % of its spread in random noise."""
    g = torch.Generator().manual_seed(seed)
    return {
        k: v + 0.05 * (float(v.std()) if v.numel() > 1 else 1.0) * torch.randn(v.shape, generator=g)
        if v.is_floating_point() else v
        for k, v in state.items()
    }  # fmt: skip


def build(workdir: Path) -> None:
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(llama_config())
    base.save_pretrained(workdir / "base")
    state = {k: v.clone() for k, v in base.state_dict().items()}

    tower = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=8
    )
    config = transformers.LlavaConfig(text_config=llama_config(), vision_config=tower, image_token_index=63)
    vision = transformers.LlavaForConditionalGeneration(config)
    language = fine_tuned(state, 1)
    vision.model.language_model.load_state_dict(
        {k.removeprefix("model."): v for k, v in language.items() if k.startswith("model.")}
    )
    vision.lm_head.load_state_dict({"weight": language["lm_head.weight"]})
    vision.save_pretrained(workdir / "vision")

    base.load_state_dict(fine_tuned(state, 2))
    base.save_pretrained(workdir / "text")

    bert = transformers.BertModel(bert_config())
    bert.save_pretrained(workdir / "bert")
    for seed, (name, labels) in enumerate((("sst2", 2), ("nli", 3)), start=3):
        classifier = transformers.BertForSequenceClassification(bert_config(labels))
        classifier.bert.load_state_dict(fine_tuned(bert.state_dict(), seed))
        classifier.save_pretrained(workdir / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", type=Path)
    build(parser.parse_args().workdir)


if __name__ == "__main__":
    main()
