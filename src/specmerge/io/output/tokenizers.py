"""Tokenizers of model folders, read with ``transformers`` from checked copies of their files, and written back.

:func:`read_tokenizer` gives the tokenizer of a model folder and its :class:`TokenVocabulary` (token string -> id,
and which tokens are added tokens, with their flags), the facts :mod:`specmerge.io.views.vocab` matches embedding rows
by. ``transformers`` never reads the input folder itself: the folder's tokenizer and config files are checked
(:func:`specmerge.io.output.model_files.tokenizer_files`, :func:`~specmerge.io.output.model_files.config_files`: regular
files inside the folder or its Hugging Face cache ``blobs/``) and copied into a private temporary folder, which
``AutoTokenizer`` reads with ``local_files_only`` and without remote code. :func:`save_tokenizer` writes a
tokenizer with tokens added (``save_pretrained``). ``transformers`` is imported only here, when a tokenizer is
needed; without it the error says which extra to install.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specmerge.io.formats.files import is_plain_file
from specmerge.io.formats.protocol import SourceError
from specmerge.io.output.model_files import copy_config_files, copy_tokenizer_files, tokenizer_files

INSTALL_HINT = "pip install 'specmerge[hf]'"
TOKEN_FLAGS = ("special", "normalized", "lstrip", "rstrip", "single_word")  # what an added token carries
# Keys transformers writes into tokenizer_config.json from the arguments of the call that loaded the tokenizer,
# not from the tokenizer: left out of a written tokenizer.
LOADING_KEYS = ("is_local", "local_files_only", "name_or_path", "trust_remote_code")


@dataclass(frozen=True)
class TokenVocabulary:
    """The tokens of a tokenizer: ``ids`` maps every token string (vocabulary entries in the tokenizer's own
    spelling, and added tokens) to its id; ``added`` the added tokens' strings to their flags (``special``,
    ``normalized``, ``lstrip``, ``rstrip``, ``single_word``)."""

    ids: Mapping[str, int]
    added: Mapping[str, Mapping[str, bool]]

    @property
    def size(self) -> int:
        """The rows a model needs for these tokens: the largest id + 1 (0 for no tokens)."""
        return max(self.ids.values(), default=-1) + 1


def transformers_module(why: str) -> Any:
    """``transformers``, imported now; a one-line SourceError saying ``why`` and what to install when missing."""
    try:
        import transformers
    except ImportError:
        raise SourceError(f"{why} needs the transformers package: {INSTALL_HINT}") from None
    return transformers


def read_tokenizer(folder: str | os.PathLike, label: str) -> tuple[Any, TokenVocabulary] | None:
    """The tokenizer of model folder ``folder`` (``label`` names it in messages, e.g. "expert 'math'") and its
    vocabulary; None when the folder (or a single weights file) has no tokenizer files.

    Every tokenizer and config file of the folder is checked and copied into a temporary folder first, and
    ``transformers.AutoTokenizer`` reads only that copy (offline, no remote code). A tokenizer that transformers
    cannot read raises SourceError naming the folder and transformers' reason.
    """
    folder = Path(folder)
    if not tokenizer_files(folder):  # checks every file; a link outside the folder is refused here
        return None
    transformers = transformers_module(f"matching the embedding rows of {label} to its tokens")
    with tempfile.TemporaryDirectory(prefix="specmerge-tokenizer-") as staged:
        copy_config_files(folder, staged)
        copy_tokenizer_files(folder, staged)
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(
                staged, local_files_only=True, trust_remote_code=False
            )
        except Exception as err:  # transformers raises many kinds; any of them means "cannot be read"
            reason = str(err).strip().splitlines()[0].replace(staged, str(folder)) if str(err).strip() else ""
            if "remote_code" in reason or "custom code" in reason:  # never points at the deleted temporary copy
                raise SourceError(
                    f"{label}: the tokenizer in {folder} needs its own Python code (auto_map), which specmerge never "
                    "runs: choose another tokenizer_source (base, or an expert whose tokenizer needs no code)"
                ) from None
            raise SourceError(
                f"{label}: transformers cannot read the tokenizer in {folder} ({type(err).__name__}"
                f"{': ' + reason[:300] if reason else ''}); repair or re-download its tokenizer files"
            ) from None
    return tokenizer, vocabulary_of(tokenizer)


def declared_added_tokens(folder: str | os.PathLike) -> frozenset[str]:
    """The added tokens the tokenizer files of ``folder`` declare, read as JSON without transformers (a cheap
    look before any tokenizer is loaded): the ``added_tokens`` of tokenizer.json, the ``added_tokens_decoder`` of
    tokenizer_config.json and the keys of added_tokens.json. Files are checked as :func:`read_tokenizer` checks
    them; one that is not valid JSON declares nothing (reading the tokenizer then says what is wrong)."""
    files = tokenizer_files(folder)
    found: set[str] = set()
    for name in ("tokenizer.json", "tokenizer_config.json", "added_tokens.json"):
        if name not in files:
            continue
        try:
            data = json.loads(files[name].read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):
            continue
        if not isinstance(data, dict):
            continue
        if name == "added_tokens.json":
            found.update(str(token) for token in data)
            continue
        entries = data.get("added_tokens" if name == "tokenizer.json" else "added_tokens_decoder")
        entries = entries.values() if isinstance(entries, dict) else entries if isinstance(entries, list) else []
        found.update(str(e["content"]) for e in entries if isinstance(e, dict) and "content" in e)
    return frozenset(found)


def token_ids(folder: str | os.PathLike) -> dict[str, int] | bytes | None:
    """What says which id each token has in ``folder``'s tokenizer, read without transformers: tokenizer.json's
    ``model.vocab`` (as a token -> id mapping; a merges-only model's list as given), else the bytes of a
    sentencepiece ``tokenizer.model``; None when neither is there (or readable)."""
    files = tokenizer_files(folder)
    if "tokenizer.json" in files:
        try:
            data = json.loads(files["tokenizer.json"].read_text(encoding="utf-8"))
            vocab = data["model"]["vocab"]
        except (OSError, ValueError, RecursionError, KeyError, TypeError):
            return None
        return vocab if isinstance(vocab, dict) else {json.dumps(entry): i for i, entry in enumerate(vocab)}
    if "tokenizer.model" in files:
        try:
            return files["tokenizer.model"].read_bytes()
        except OSError:
            return None
    return None


def vocabulary_of(tokenizer: Any) -> TokenVocabulary:
    """The :class:`TokenVocabulary` of a transformers tokenizer (``get_vocab`` and ``added_tokens_decoder``)."""
    ids = {str(token): int(i) for token, i in tokenizer.get_vocab().items()}
    added = {
        str(token.content): {flag: bool(getattr(token, flag, False)) for flag in TOKEN_FLAGS}
        for token in tokenizer.added_tokens_decoder.values()
    }
    return TokenVocabulary(ids, added)


def add_tokens(tokenizer: Any, tokens: Sequence[tuple[str, Mapping[str, bool]]]) -> TokenVocabulary:
    """Add ``tokens`` (string, flags), in order, to ``tokenizer`` (changed in place); return its new vocabulary."""
    transformers = transformers_module("writing a tokenizer with added tokens")
    for content, flags in tokens:
        token = transformers.AddedToken(content, **{flag: bool(flags.get(flag, False)) for flag in TOKEN_FLAGS})
        tokenizer.add_tokens([token], special_tokens=token.special)
    return vocabulary_of(tokenizer)


def save_tokenizer(tokenizer: Any, out_dir: str | os.PathLike) -> list[str]:
    """Write ``tokenizer`` into ``out_dir`` with ``save_pretrained``; return the names of the files written.

    The keys transformers adds to ``tokenizer_config.json`` from the arguments a tokenizer was loaded with
    (``LOADING_KEYS``), which say nothing about the tokenizer, are left out. A file of the tokenizer that
    ``out_dir`` already holds is refused (nothing is replaced).
    """
    out_dir = Path(out_dir)
    before = set(os.listdir(out_dir))
    with tempfile.TemporaryDirectory(prefix=".tokenizer-", dir=out_dir) as staged:
        tokenizer.save_pretrained(staged)
        written = sorted(os.listdir(staged))
        config = Path(staged) / "tokenizer_config.json"
        if is_plain_file(config):
            _drop_loading_keys(config)
        for name in written:
            if name in before:
                raise SourceError(f"the merged tokenizer's file {name} would replace another output file of that name")
            os.replace(Path(staged) / name, out_dir / name)
    return written


def _drop_loading_keys(config: Path) -> None:
    data = json.loads(config.read_text(encoding="utf-8"))
    if isinstance(data, dict) and any(key in data for key in LOADING_KEYS):
        kept = {key: value for key, value in data.items() if key not in LOADING_KEYS}
        config.write_text(json.dumps(kept, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
