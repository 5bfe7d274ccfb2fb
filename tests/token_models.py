"""Experts with added tokens, built offline: the README's example script (examples/added_tokens.py) as a module.

``build(root, tie=...)`` saves a tiny Llama base (tiny_models.llama_config) with a word-level tokenizer of 64
tokens and the experts ``tool`` (adds ``<tool>``, ``<think>``), ``math`` (adds ``<think>``, ``<math>``) and
``chat`` (adds none); ``weights`` and ``vocabulary`` read a saved folder back.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from tiny_models import llama_config

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "added_tokens.py"


def load_example():
    """The example script examples/added_tokens.py, imported from its file."""
    spec = importlib.util.spec_from_file_location("added_tokens_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


example = load_example()
ADDED = example.ADDED
KEYS = list(ADDED)


def build(root: Path, *, tie: bool = False) -> tuple[Path, list[Path]]:
    """The base and the experts ``tool``, ``math``, ``chat`` under ``root`` (see the module docstring)."""
    config = llama_config()
    config.tie_word_embeddings = tie
    return example.build(root, config=config)


def weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a saved model folder."""
    found = {}
    for file in sorted(folder.glob("*.safetensors")):
        found.update(load_file(file))
    return found


def vocabulary(folder: Path) -> dict[str, int]:
    """Token string -> id of the tokenizer saved in ``folder`` (its tokenizer.json: model vocabulary and added
    tokens), read without transformers."""
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    ids = dict(data["model"]["vocab"])
    ids.update({token["content"]: token["id"] for token in data["added_tokens"]})
    return ids


def padded_family(root: Path) -> tuple[Path, list[Path]]:
    """A base with 72 embedding rows for its 64 tokens (rows 64-71 padding) and two experts of the same rows:
    ``tool`` added ``<tool>`` at id 64, in a padding row, without resizing; ``chat`` added nothing."""
    import transformers

    config = llama_config()
    config.vocab_size = 72
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "base")
    example.word_tokenizer().save_pretrained(root / "base")
    tool = example.save_expert(root / "base", root / "tool", [], seed=11)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tool)
    tokenizer.add_tokens(["<tool>"], special_tokens=True)
    tokenizer.save_pretrained(tool)
    return root / "base", [tool, example.save_expert(root / "base", root / "chat", [], seed=12)]
