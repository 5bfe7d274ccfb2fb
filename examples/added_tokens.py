"""Build a tiny Llama base and three experts fine-tuned from it, two of which add tokens to the vocabulary.

    python examples/added_tokens.py WORKDIR

writes, with random weights and a word-level tokenizer of 64 tokens (``<unk>``, ``<s>``, ``</s>``, ``w0`` ...
``w60``):

- ``WORKDIR/base``: the base model and its tokenizer;
- ``WORKDIR/tool``: adds ``<tool>`` (id 64) and ``<think>`` (id 65);
- ``WORKDIR/math``: adds ``<think>`` (id 64, the row ``tool`` uses for ``<tool>``) and ``<math>`` (id 65);
- ``WORKDIR/chat``: adds no token.

Each expert is the base with every weight perturbed (a stand-in for fine-tuning), its tokenizer with the tokens
added, and its embeddings and head resized (``resize_token_embeddings``) with the new rows set. Merge them with
``specmerge merge WORKDIR/base WORKDIR/tool WORKDIR/math WORKDIR/chat -o WORKDIR/merged`` (README, "Experts with
added tokens").
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

WORDS = ["<unk>", "<s>", "</s>", *(f"w{i}" for i in range(61))]  # 64 tokens: the tiny Llama's rows
ADDED = {"tool": ["<tool>", "<think>"], "math": ["<think>", "<math>"], "chat": []}


def tiny_llama_config(tie: bool = False) -> transformers.LlamaConfig:
    """A 2-layer Llama of width 32 with a vocabulary of 64 rows."""
    return transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=len(WORDS), max_position_embeddings=64, tie_word_embeddings=tie,
    )  # fmt: skip


def word_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer of ``WORDS`` (split on whitespace; unknown words are ``<unk>``)."""
    model = Tokenizer(models.WordLevel({word: i for i, word in enumerate(WORDS)}, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=model, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def save_expert(base: Path, folder: Path, tokens: list[str], seed: int) -> Path:
    """The base with every weight perturbed, ``tokens`` added to its tokenizer and new embedding rows set."""
    generator = torch.Generator().manual_seed(seed)
    model = transformers.LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.02 * torch.randn(parameter.shape, generator=generator))
        if tokens:
            tokenizer.add_tokens(tokens, special_tokens=True)
            model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
            for matrix in {id(m): m for m in (model.get_input_embeddings().weight, model.lm_head.weight)}.values():
                matrix[-len(tokens) :] = torch.randn(len(tokens), matrix.shape[1], generator=generator)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def build(root: Path, *, config: transformers.LlamaConfig | None = None, seed: int = 0) -> tuple[Path, list[Path]]:
    """Save the base and the experts of ``ADDED`` under ``root``; return the base's folder and the experts'."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config or tiny_llama_config()).eval()
    model.save_pretrained(root / "base")
    word_tokenizer().save_pretrained(root / "base")
    experts = [
        save_expert(root / "base", root / name, tokens, seed * 100 + i + 1)
        for i, (name, tokens) in enumerate(ADDED.items())
    ]
    return root / "base", experts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", type=Path, help="folder to write the base and the experts into (created)")
    root = parser.parse_args().workdir
    transformers.utils.logging.disable_progress_bar()
    base, experts = build(root)
    print(f"base: {base}")
    for expert, (name, tokens) in zip(experts, ADDED.items(), strict=True):
        print(f"expert {name}: {expert} (adds {', '.join(tokens) or 'no token'})")


if __name__ == "__main__":
    main()
