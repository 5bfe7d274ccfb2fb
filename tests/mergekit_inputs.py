"""The tiny models of the mergekit corpus (tests/mergekit_corpus, issue 51): a 4-layer Llama base and three experts,
built the same way by bench/mergekit_reference.py (which runs mergekit on them once, for the committed reference
outputs) and by the tests (which run specmerge on them and compare). Each config names its models ``$base``,
``$e0``, ``$e1``, ``$e2``, and ``$lora0``, a PEFT LoRA adapter of the base (mergekit's ``$base+$lora0``);
:func:`render` puts the folders in. Configs about tokenizers use a second family with a
word-level tokenizer whose experts add tokens (tests/token_models.py): ``$tbase``, ``$ttool`` (adds ``<tool>``,
``<think>``), ``$tmath`` (adds ``<think>``, ``<math>``), ``$tchat`` (adds none)."""

from __future__ import annotations

import hashlib
import json
import string
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file

CORPUS = Path(__file__).parent / "mergekit_corpus"
REFERENCES = Path(__file__).parent / "data" / "mergekit"
NAMES = ("base", "e0", "e1", "e2")
LORA_NAMES = ("lora0",)
TOKEN_NAMES = ("tbase", "ttool", "tmath", "tchat")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def build_inputs(root: Path) -> dict[str, Path]:
    """The base (random, seed 0) and three experts (base + a rank-2 update and small noise on every floating
    tensor, seeds 1-3: about 15 % of the base's weights, far enough apart for slerp's arcs, near enough to pass
    for fine-tunes), saved in float32 under ``root``; their folders by name."""
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    folders = {"base": root / "base"}
    model.save_pretrained(folders["base"])
    base = {k: v.clone() for k, v in model.state_dict().items()}
    for i in range(3):
        g = torch.Generator().manual_seed(i + 1)
        state = {}
        for name, value in base.items():
            if value.dim() == 2:
                u, v = torch.randn(value.shape[0], 2, generator=g), torch.randn(2, value.shape[1], generator=g)
                delta = 0.004 * (u @ v) / 2 + 0.001 * torch.randn(value.shape, generator=g)  # ~15 % of W_0
            else:
                delta = 0.01 * torch.randn(value.shape, generator=g)
            state[name] = value + delta
        model.load_state_dict(state)
        folders[f"e{i}"] = root / f"e{i}"
        model.save_pretrained(folders[f"e{i}"])
    model.load_state_dict(base)
    folders["lora0"] = _lora_adapter(model, root / "lora0")
    from token_models import build  # the family with added tokens (its own seeds)

    token_base, token_experts = build(root / "tokens")
    folders.update(zip(TOKEN_NAMES, [token_base, *token_experts], strict=True))
    return folders


def _lora_adapter(model: transformers.PreTrainedModel, folder: Path) -> Path:
    """A rank-4 LoRA adapter of ``model`` on attention and MLP projections, its factors random (seed 4, about the
    experts' size), saved with PEFT; the model is left as it was."""
    from tiny_models import random_lora

    targets = ["q_proj", "v_proj", "down_proj"]
    wrapped = random_lora(model, 4, std=0.03, r=4, lora_alpha=8, target_modules=targets)
    wrapped.save_pretrained(folder)
    wrapped.unload()
    return folder


def inputs_digest(folders: dict[str, Path], names: tuple[str, ...] = NAMES) -> str:
    """A hash of the inputs' tensors (names, dtypes, shapes, bytes) and tokenizer files, to check that the tests rebuilt
    the very models the references were made from; ``names``: the family (:func:`family`)."""
    digest = hashlib.sha256()
    for name in names:
        weights = folders[name] / "model.safetensors"
        state = load_file(weights if weights.is_file() else folders[name] / "adapter_model.safetensors")
        for key in sorted(state):
            tensor = state[key].contiguous()
            digest.update(f"{name}|{key}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
        for file in TOKENIZER_FILES:
            if (folders[name] / file).is_file():
                digest.update(f"{name}|{file}|".encode() + (folders[name] / file).read_bytes())
    return digest.hexdigest()


def family(config: Path) -> tuple[str, ...]:
    """The models a config's references depend on: the token family when it names one of them, else the first (with
    the LoRA adapter when it names it)."""
    text = config.read_text()
    if any(f"${name}" in text for name in TOKEN_NAMES):
        return TOKEN_NAMES
    return NAMES + LORA_NAMES if any(f"${name}" in text for name in LORA_NAMES) else NAMES


def configs() -> list[Path]:
    """The corpus's configs, by name."""
    return sorted(CORPUS.glob("*.yaml"))


def render(config: Path, folders: dict[str, Path]) -> str:
    """The config's text with the models' folders in place of ``$base``, ``$e0``, ..."""
    return string.Template(config.read_text()).substitute({name: str(path) for name, path in folders.items()})


def config_digest(config: Path) -> str:
    return hashlib.sha256(config.read_bytes()).hexdigest()


def tokenizer_record(out: Path) -> dict:
    """The vocabulary (token -> id, model and added tokens) and chat template of an output folder, {} when it has no
    tokenizer: what bench/mergekit_reference.py records of mergekit's outputs and the tests compare with."""
    if not (out / "tokenizer.json").is_file():
        return {}
    data = json.loads((out / "tokenizer.json").read_text())
    vocabulary = {**data["model"]["vocab"], **{t["content"]: t["id"] for t in data["added_tokens"]}}
    template = (out / "chat_template.jinja").read_text() if (out / "chat_template.jinja").is_file() else None
    if template is None:
        template = json.loads((out / "tokenizer_config.json").read_text()).get("chat_template")
    return {"vocabulary": vocabulary, "chat_template": template}
