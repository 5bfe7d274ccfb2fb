"""A merged model's files besides its weights: config, tokenizer and code, and the dtype and vocabulary in config.json.

A model folder's non-weight files are of two kinds: those that go with the config (:func:`config_files`:
config.json, generation and processor configs, remote code) and those that go with the tokenizer
(:func:`tokenizer_files`), since a merged model may take its config from one input and its tokenizer from another.
:func:`copy_model_files` copies both kinds from one folder (:func:`copy_config_files`,
:func:`copy_tokenizer_files`: one kind), each file checked by :func:`specmerge.io.formats.files.folder_file` (nothing
outside the input folder is copied); :func:`write_output_config` makes ``config.json`` state the dtype the
weights were written in and, when the vocabulary changed, its number of rows.
"""

from __future__ import annotations

import fnmatch
import logging
import math
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from stat import S_ISREG
from typing import Any

import torch

from specmerge.errors import SpecmergeError
from specmerge.io.formats.files import folder_file, read_json, write_json
from specmerge.io.formats.names import CONFIG_FILE
from specmerge.io.formats.protocol import SourceError, TensorInfo
from specmerge.io.output.folder import OUTPUT_LOG

# Files of a Hugging Face folder that are not weights and that a merged model needs (top level only): those that go
# with the config (the model's architecture, generation settings, processors, remote code) ...
CONFIG_FILE_PATTERNS = (
    "config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "processor_config.json",
    "image_processor*.json",
    "video_preprocessor*.json",
    "*.py",
)
# ... and those that go with the tokenizer (its vocabulary, added tokens, special tokens and chat template).
TOKENIZER_FILE_PATTERNS = (
    "tokenizer*.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "spiece.model",
    "*.bpe.model",
    "*.tiktoken",
    "chat_template.*",
)
MODEL_FILE_PATTERNS = CONFIG_FILE_PATTERNS + TOKENIZER_FILE_PATTERNS
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.index.json")


def is_weight_file(name: str) -> bool:
    """Whether a file name (as a repository lists it) is one of a checkpoint's weight files (``WEIGHT_PATTERNS``)."""
    return any(fnmatch.fnmatchcase(name, p) for p in WEIGHT_PATTERNS)


def write_output_config(
    out_dir: str | os.PathLike,
    weights: Iterable[TensorInfo],
    *,
    vocab_size: int | None = None,
    quantization: Mapping[str, Any] | None = None,
    layers: int | None = None,
) -> str | None:
    """Make ``out_dir/config.json`` state the dtype the weights were written in; return it (None: nothing to do).

    The dtype is that of most of the floating-point weights, by element count (of all of them when the output
    was cast to one dtype). It goes in ``torch_dtype`` (read by every transformers version) and in ``dtype``
    where the config has that newer key, so that ``from_pretrained(out, dtype="auto")`` loads the weights as
    written. When all floating weights share the dtype, nested sub-model configs that state a dtype say it
    too. ``vocab_size`` (the rows of the merged token embeddings, given when the vocabulary differs from the
    config's input) goes in ``vocab_size`` at the top level (unless only a nested ``text_config`` states it, as in
    vision-language configs) and in ``text_config.vocab_size`` where that exists. The file is rewritten only if this
    changes it; a missing config, or one that is not a JSON object, is left as it is.

    A ``quantization_config`` (or ``compression_config``) taken over from a quantized input is removed
    (transformers would otherwise read the dense weights as quantized ones), and the console says so; with
    ``quantization`` (the weights written quantized, ``weights`` then being the dense tensors they stand for) it
    becomes the config's ``quantization_config``. ``layers``: a frankenmerge's layer count, stated as
    ``num_hidden_layers``.
    """
    counts: dict[torch.dtype, int] = {}
    for info in weights:
        if info.dtype.is_floating_point:
            counts[info.dtype] = counts.get(info.dtype, 0) + math.prod(info.shape)
    path = Path(out_dir) / CONFIG_FILE
    config = read_json(path)
    if not counts or not isinstance(config, dict):
        return None
    name = str(max(counts, key=counts.__getitem__)).removeprefix("torch.")
    stated = _without_quantization(_state_dtype(config, name, nested=len(counts) == 1), name, quantization is None)
    if quantization is not None:
        stated["quantization_config"] = dict(quantization)
    stated["torch_dtype"] = name
    if vocab_size is not None:
        stated = _state_vocab_size(stated, vocab_size)
    if layers is not None:
        stated = _state_layers(stated, layers)
    if stated != config:
        write_json(path, stated, indent=2)
    return name


QUANTIZATION_KEYS = ("quantization_config", "compression_config")


def _without_quantization(config: dict, dtype: str, say: bool = True) -> dict:
    """``config`` without its quantization sections (top level and sub-configs), said on the console."""
    stated = {}
    for key, value in config.items():
        if key in QUANTIZATION_KEYS:
            if not say:
                continue
            method = value.get("quant_method", "?") if isinstance(value, dict) else "?"
            logging.getLogger(OUTPUT_LOG).info(
                f"the merged weights are written dense ({dtype}): config.json's {key} ({method}) is not carried over"
            )
            continue
        stated[key] = _without_quantization(value, dtype, say) if isinstance(value, dict) else value
    return stated


LAYER_COUNT = "num_hidden_layers"


def check_layer_count(config: Any) -> None:
    """Refuse a frankenmerge of a model whose config cannot say its new layer count: no ``num_hidden_layers``, or
    a value listed per layer (``layer_types``: which value each stacked layer takes is not known)."""
    where = _layer_config(config) if isinstance(config, dict) else None
    if where is None:
        raise SpecmergeError(
            f"config.json states no {LAYER_COUNT}: a frankenmerge of this architecture is not supported"
        )
    per_layer = [k for k, v in where.items() if isinstance(v, list) and len(v) == where[LAYER_COUNT]]
    if per_layer:
        raise SpecmergeError(
            f"config.json lists a value per layer ('{per_layer[0]}'): a frankenmerge of such a model is not supported"
        )


def _layer_config(config: dict) -> dict | None:
    """The (sub-)config that states ``num_hidden_layers``: ``text_config`` where it does, else the top level."""
    text = config.get("text_config")
    if isinstance(text, dict) and LAYER_COUNT in text:
        return text
    return config if LAYER_COUNT in config else None


def _state_layers(config: dict, layers: int) -> dict:
    """A copy of ``config`` whose ``num_hidden_layers`` (``text_config``'s where it states it) is ``layers``."""
    stated = dict(config)
    if _layer_config(stated) is stated.get("text_config"):
        stated["text_config"] = {**stated["text_config"], LAYER_COUNT: layers}
    else:
        stated[LAYER_COUNT] = layers
    return stated


def _state_vocab_size(config: dict, rows: int) -> dict:
    """A copy of ``config`` whose ``vocab_size`` (top level, and ``text_config``'s where present) is ``rows``."""
    stated = dict(config)
    text = stated.get("text_config")
    if isinstance(text, dict):
        stated["text_config"] = {**text, "vocab_size": rows}
    if "vocab_size" in stated or not isinstance(text, dict):
        stated["vocab_size"] = rows
    return stated


def _state_dtype(config: dict, name: str, nested: bool) -> dict:
    """A copy of ``config`` whose ``torch_dtype`` / ``dtype`` keys (and, if ``nested``, those of sub-configs) say
    ``name``."""
    stated = {}
    for key, value in config.items():
        if key in ("torch_dtype", "dtype") and (value is None or isinstance(value, str)):
            value = name
        elif nested and isinstance(value, dict):
            value = _state_dtype(value, name, nested)
        stated[key] = value
    return stated


def model_files(base_dir: str | os.PathLike) -> dict[str, Path]:
    """The non-weight files of a Hugging Face folder that a merged model needs: name -> real path, by name.

    Top-level files whose names match ``MODEL_FILE_PATTERNS`` (config, tokenizer, processor, remote code);
    weights, indexes, README.md and subfolders are left out. Each is checked by
    :func:`specmerge.io.formats.files.folder_file`: a link that leads outside the folder (other than into its Hugging
    Face cache ``blobs/``), a dangling link or anything but a regular file raises SourceError naming the link and its
    target. A single-file base has none.
    """
    return _matching_files(base_dir, MODEL_FILE_PATTERNS)


def config_files(folder: str | os.PathLike) -> dict[str, Path]:
    """The files of :func:`model_files` that go with the config (``CONFIG_FILE_PATTERNS``: config.json, generation
    and processor configs, remote code), checked the same way."""
    return _matching_files(folder, CONFIG_FILE_PATTERNS)


def tokenizer_files(folder: str | os.PathLike) -> dict[str, Path]:
    """The files of :func:`model_files` that go with the tokenizer (``TOKENIZER_FILE_PATTERNS``: tokenizer.json,
    its config, vocabularies, merges, sentencepiece models, special and added tokens, chat templates), checked the
    same way."""
    return _matching_files(folder, TOKENIZER_FILE_PATTERNS)


def _matching_files(folder: str | os.PathLike, patterns: tuple[str, ...]) -> dict[str, Path]:
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    try:
        names = sorted(os.listdir(folder))
    except OSError as err:
        raise SourceError(f"{folder}: cannot list the folder ({err.strerror or err})") from None
    files = {}
    for name in names:
        path = folder / name
        if any(fnmatch.fnmatch(name, p) for p in WEIGHT_PATTERNS):
            continue
        if not any(fnmatch.fnmatch(name, p) for p in patterns) or (path.is_dir() and not path.is_symlink()):
            continue
        files[name] = folder_file(path, folder)
    return files


def copy_model_files(base_dir: str | os.PathLike, out_dir: str | os.PathLike) -> list[str]:
    """Copy :func:`model_files` of ``base_dir`` (its config and tokenizer files) into ``out_dir`` as new files;
    return their names, sorted.

    The copies are created with mode 0644 (less under the umask), whatever the source's mode: no execute,
    setuid or group/other write bit is carried over. A file that has become anything but a regular file since
    it was checked is refused.
    """
    return _copy_files(base_dir, model_files(base_dir), out_dir)


def copy_config_files(folder: str | os.PathLike, out_dir: str | os.PathLike) -> list[str]:
    """Copy the :func:`config_files` of ``folder`` into ``out_dir``, as :func:`copy_model_files` does."""
    return _copy_files(folder, config_files(folder), out_dir)


def copy_tokenizer_files(folder: str | os.PathLike, out_dir: str | os.PathLike) -> list[str]:
    """Copy the :func:`tokenizer_files` of ``folder`` into ``out_dir``, as :func:`copy_model_files` does."""
    return _copy_files(folder, tokenizer_files(folder), out_dir)


def _copy_files(folder: str | os.PathLike, files: dict[str, Path], out_dir: str | os.PathLike) -> list[str]:
    for name, real in files.items():
        _copy_regular_file(Path(folder) / name, real, Path(out_dir) / name)
    return list(files)


def _copy_regular_file(shown: Path, real: Path, target: Path) -> None:
    try:
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        raise SourceError(f"{shown}: cannot be read ({err.strerror or err})") from None
    with open(fd, "rb") as source:
        if not S_ISREG(os.fstat(fd).st_mode):
            raise SourceError(f"{shown} is not a regular file; specmerge copies only files")
        out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
        with open(out, "wb") as copy:
            shutil.copyfileobj(source, copy, 2**20)
