"""Experts with added tokens: the rows of token embeddings and output heads matched by token string.

Chat and domain fine-tunes grow the vocabulary, so their ``embed_tokens`` / ``lm_head`` (``wte``, ``shared``,
``word_embeddings``, ...: :func:`vocabulary_tensors`) have more rows than the base's, and a row's index means
different tokens in different experts. :func:`align_vocabulary` matches the rows by the token strings of the
inputs' tokenizers (:mod:`specmerge.io.output.tokenizers`), never by index, and gives lazy views of the base and the
experts whose vocabulary tensors have the output's rows, in the output's token order
(:mod:`specmerge.io.views.vocab_views`), so that the plan and the merge run on them unchanged.

The output vocabulary follows ``tokenizer_source``:

- ``union`` (default): the base's tokens at their ids, then every token some expert added that the base lacks,
  in expert order and each expert's id order, each once, with its flags (special, normalized, ...), at the ids
  the base tokenizer gives them when they are added to it (``len(tokenizer)`` on: a base whose embeddings have
  rows beyond its tokenizer (padding) gets them there first). With no token added it is the base's vocabulary.
- ``base``: the base's tokens; tokens experts added are dropped (listed in the report).
- an expert's key: that expert's tokenizer and rows.

Rows, per output row of token t: the base view holds the base's row of t, or, for a token the base lacks, the
average of the rows of the experts that have t (its holders; float32, or float64 when an input is, cast to the
base's dtype); each expert view holds its own row of t, or, lacking t, the base view's row (a zero task vector).
Rows beyond a tokenizer's tokens (padding) stay by index. So a merge that averages (W_0 + mean of the task
vectors) gives a shared token W_0 + mean_i(tau_i) and an added token exactly the mean of its holders' rows (their
deltas from it sum to zero); ``keep_base`` gives the base's rows and the holders' mean for added tokens.

Nothing is re-rowed (the inputs are returned as they are, no tokenizer loaded) when ``tokenizer_source`` is ``base``
or ``union``, no expert's vocabulary tensors have other rows than the base's, and no expert's tokenizer files
declare an added token that the base's do not (:func:`~specmerge.io.output.tokenizers.declared_added_tokens`, which
catches tokens added in a base's padding rows without resizing): the base's vocabulary and tokenizer files are
the output's, as before. LoRA adapters keep the base's vocabulary; one that changes a
vocabulary tensor is refused when the vocabulary is aligned.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specmerge.io.formats.protocol import SourceError, TensorInfo, TensorSource
from specmerge.io.output.model_files import copy_tokenizer_files, tokenizer_files
from specmerge.io.output.tokenizers import (
    TokenVocabulary,
    add_tokens,
    declared_added_tokens,
    read_tokenizer,
    save_tokenizer,
    token_ids,
)
from specmerge.io.views.experts import Expert
from specmerge.io.views.vocab_views import RowMap, aligned_views

LOG = logging.getLogger("specmerge.inputs")  # what the console says of the inputs

# Name components of token embeddings and output heads (one row per token), across model families.
VOCABULARY_COMPONENTS = frozenset(
    {
        "embed_tokens", "embed_in", "embed_out", "tok_embeddings",  # Llama, OPT, GPT-NeoX, Meta
        "wte", "word_embeddings", "shared", "token_embedding",  # GPT-2, BERT/BLOOM/Falcon, T5, CLIP
        "lm_head", "output_layer",  # output heads (ChatGLM calls it output_layer)
    }
)  # fmt: skip
VOCABULARY_NAMES = frozenset({"output.weight"})  # Meta's original lm_head
VOCABULARY_SUFFIXES = ("predictions.decoder.weight", "predictions.decoder.bias", "predictions.bias")  # BERT MLM
TOKENIZER_SOURCES = ("base", "union")  # besides an expert's key
MOST_MISSING = 0.5  # an expert whose tokenizer lacks more than this share of the base's tokens has another one
SHOWN = 10  # examples of renamed tokens listed per expert in the report


def is_vocabulary_tensor(name: str) -> bool:
    """Whether ``name`` is a token embedding or output head (one row per token) by its name."""
    if name in VOCABULARY_NAMES or name.endswith(VOCABULARY_SUFFIXES):
        return True
    return any(part in VOCABULARY_COMPONENTS for part in name.split("."))


def vocabulary_tensors(infos: Mapping[str, TensorInfo]) -> tuple[list[str], int | None]:
    """The floating tensors named as token embeddings or heads whose first dimension is the first one's (the
    vocabulary rows), and those rows (None: no such tensor)."""
    found = [i for i in infos.values() if i.shape and i.dtype.is_floating_point and is_vocabulary_tensor(i.name)]
    if not found:
        return [], None
    rows = found[0].shape[0]
    return [i.name for i in found if i.shape[0] == rows], rows


@dataclass
class VocabularyPlan:
    """The output's vocabulary: where its tokenizer comes from and how many rows its vocabulary tensors have.

    ``rows`` is None when the vocabulary is the base's, unchanged; ``tokenizer`` is a transformers tokenizer to
    save (the union with added tokens), else ``tokenizer_from`` the folder whose tokenizer files are copied
    (None: none). ``notes`` go into report.json under ``vocabulary`` (empty: nothing to say).
    """

    source: str
    rows: int | None
    tokenizer_from: Path | None
    tokenizer: Any = None
    notes: dict[str, Any] = field(default_factory=dict)

    def write_tokenizer(self, out_dir: str | os.PathLike) -> list[str]:
        """Write the output's tokenizer files into ``out_dir``; return their names."""
        if self.tokenizer is not None:
            return save_tokenizer(self.tokenizer, out_dir)
        return [] if self.tokenizer_from is None else copy_tokenizer_files(self.tokenizer_from, out_dir)


def folder_of(path: Path) -> Path | None:
    """The model folder of an input path (None for a single weights file, which has no tokenizer)."""
    return path if path.is_dir() else None


def align_vocabulary(
    base: TensorSource,
    experts: Sequence[Expert],
    *,
    base_path: Path,
    expert_paths: Sequence[Path],
    keys: Sequence[str],
    tokenizer_source: str | int = "union",
    kept_from_base: Callable[[str], bool] | None = None,
) -> tuple[TensorSource, list[Expert], VocabularyPlan]:
    """The base and experts with their vocabulary tensors re-rowed to the output vocabulary, and its plan.

    ``tokenizer_source`` is ``base``, ``union`` or the index of an expert (``keys`` name them, ``expert_paths``
    are their local paths); ``kept_from_base(name)`` says whether the merge keeps a tensor from the base (with
    ``base`` and every vocabulary tensor kept, nothing needs matching: the inputs are returned as they are).
    Reads tokenizers, never tensor data. Raises SourceError, one line, for what cannot be matched: an expert with
    other rows and no tokenizer, a tokenizer that does not fit its rows or is another tokenizer than the base's,
    an adapter that changes a vocabulary tensor.
    """
    experts = list(experts)
    chosen = tokenizer_source if isinstance(tokenizer_source, int) else None
    shown = keys[chosen] if chosen is not None else str(tokenizer_source)
    unchanged = VocabularyPlan(shown, None, folder_of(base_path))
    names, base_rows = vocabulary_tensors(base.infos())
    if base_rows is None:
        if chosen is not None:
            raise SourceError(
                f"tokenizer_source '{shown}': the base has no token embedding or output head (by name, e.g. "
                "embed_tokens, lm_head) whose rows could follow that expert's tokenizer; use base or union"
            )
        return base, experts, unchanged
    labels = [f"expert '{key}'" for key in keys]
    rows = [_expert_rows(names, base.infos(), e.infos(), label) for e, label in zip(experts, labels, strict=True)]
    if (
        chosen is None
        and all(r in (None, base_rows) for r in rows)
        and not _declare_new_tokens(base_path, experts, expert_paths)
    ):
        return base, experts, unchanged
    if tokenizer_source == "base" and kept_from_base is not None and all(kept_from_base(n) for n in names):
        return base, experts, unchanged
    _refuse_adapters(experts, names, labels, chosen)
    base_tokenizer, base_vocab = _read_base(base_path, names, base_rows, rows, keys)
    rows = [base_rows if r is None else r for r in rows]
    vocabs, sources = _read_experts(experts, expert_paths, labels, rows, base_rows, base_vocab, names[0])
    for vocab, label, n in zip([base_vocab, *vocabs], ["the base", *labels], [base_rows, *rows], strict=True):
        _check_fits(vocab, label, n, names[0])
    compared = [_compare(base_vocab, vocab, label) for vocab, label in zip(vocabs, labels, strict=True)]
    plan, out_vocab = _output_vocabulary(shown, chosen, base_tokenizer, base_vocab, vocabs, keys)
    if plan.tokenizer is None:  # the files of the chosen expert's tokenizer, or of the base's
        plan.tokenizer_from = folder_of(expert_paths[chosen] if chosen is not None else base_path)
    plan.rows = max(base_rows, out_vocab.size) if chosen is None else rows[chosen]
    for vocab, label, n in zip(vocabs, labels, rows, strict=True):  # rows no token names, beyond the output's
        if n > plan.rows and n > vocab.size:
            LOG.warning(
                f"{label} has {n} rows in '{names[0]}' but its tokenizer names {vocab.size} tokens: the "
                f"{n - max(plan.rows, vocab.size)} rows beyond both (padding, or rows of tokens its tokenizer does not "
                f"name) are not in the output, which has {plan.rows}"
            )
    row_map = RowMap.build(out_vocab, plan.rows, base_vocab, base_rows, vocabs, rows)
    plan.notes = {
        "tokenizer_source": shown,
        "tensors": names,
        "base_rows": base_rows,
        "output_rows": plan.rows,
        **_token_notes(out_vocab, base_vocab, vocabs, keys),
        "experts": {
            key: {"rows": n, "tokenizer": source, **more}
            for key, n, source, more in zip(keys, rows, sources, compared, strict=True)
        },
    }
    base_view, expert_views = aligned_views(base, experts, names, row_map)
    return base_view, expert_views, plan


def _declare_new_tokens(base_path: Path, experts: Sequence[Expert], expert_paths: Sequence[Path]) -> bool:
    """Whether a full expert's tokenizer files declare an added token that the base's do not (a token added in
    the base's padding rows, without resizing the embeddings), or whose token ids differ from the base's (another
    id for a token at the same vocabulary size): then rows are matched by token too. Only a base with tokenizer
    files can tell (adapters keep the base's vocabulary)."""
    folder = folder_of(base_path)
    if folder is None or not tokenizer_files(folder):
        return False
    declared = declared_added_tokens(folder)
    base_ids = functools.cache(lambda: token_ids(folder))  # read at most once, and only if an expert has files
    for expert, path in zip(experts, expert_paths, strict=True):
        other = folder_of(path)
        if expert.low_rank or other is None or not tokenizer_files(other):
            continue
        if declared_added_tokens(other) - declared:
            return True
        if base_ids() is not None and token_ids(other) not in (None, base_ids()):
            return True  # the same size, other ids for the tokens: rows are matched by token, not by id
    return False


def _refuse_adapters(
    experts: Sequence[Expert], names: Sequence[str], labels: Sequence[str], chosen: int | None
) -> None:
    """LoRA adapters keep the base's vocabulary rows: one that changes a vocabulary tensor, or is the
    tokenizer_source, is out of scope."""
    for i, (expert, label) in enumerate(zip(experts, labels, strict=True)):
        if not expert.low_rank:
            continue
        touched = next((n for n in names if expert.changes(n)), None)
        if touched is not None or i == chosen:
            what = f"changes '{touched}'" if touched else "is the tokenizer_source"
            raise SourceError(
                f"{label} is a LoRA adapter that {what}, and the vocabulary is matched by token (experts with other "
                "vocabulary rows): an adapter's own vocabulary rows are not supported; merge the adapter into its "
                "model first"
            )


def _read_experts(
    experts: Sequence[Expert],
    paths: Sequence[Path],
    labels: Sequence[str],
    rows: Sequence[int],
    base_rows: int,
    base_vocab: TokenVocabulary,
    name: str,
) -> tuple[list[TokenVocabulary], list[str]]:
    """Each expert's vocabulary and where it comes from: its own tokenizer; the base's for an adapter, or for a
    checkpoint without tokenizer files that has the base's rows; refused for one with other rows."""
    vocabs, sources = [], []
    for expert, path, label, n in zip(experts, paths, labels, rows, strict=True):
        read = None if expert.low_rank or folder_of(path) is None else read_tokenizer(path, label)
        if read is None and n != base_rows:
            raise SourceError(
                f"{label} has {n} rows in '{name}' but the base {base_rows}, and no tokenizer files in {path}: its "
                "rows cannot be matched to tokens; add the tokenizer it was trained with (tokenizer.json, "
                "tokenizer_config.json, ...), or keep the base's vocabulary (tokenizer_source: base and an override "
                f"with action keep_base for '{name}')"
            )
        vocabs.append(base_vocab if read is None else read[1])
        if read is not None:
            sources.append("own")
        else:
            sources.append("the base's (a LoRA adapter)" if expert.low_rank else "the base's (no tokenizer files)")
    return vocabs, sources


def _expert_rows(
    names: Sequence[str], base: Mapping[str, TensorInfo], expert: Mapping[str, TensorInfo], label: str
) -> int | None:
    """The rows of the expert's vocabulary tensors (those shaped like the base's but for the rows); None: none."""
    found = {n: expert[n].shape[0] for n in names if n in expert and expert[n].shape[1:] == base[n].shape[1:]}
    if len(set(found.values())) > 1:
        shown = ", ".join(f"'{n}' {r}" for n, r in found.items())
        raise SourceError(f"{label}: its token embeddings and heads disagree on the vocabulary rows ({shown})")
    return next(iter(found.values()), None)


def _read_base(
    base_path: Path, names: Sequence[str], base_rows: int, rows: Sequence[int | None], keys: Sequence[str]
) -> tuple[Any, TokenVocabulary]:
    folder = folder_of(base_path)
    read = None if folder is None else read_tokenizer(folder, "the base")
    if read is None:
        other = next(
            (f"expert '{k}' has {r}" for k, r in zip(keys, rows, strict=True) if r not in (None, base_rows)), ""
        )
        raise SourceError(
            f"the base '{base_path}' has no tokenizer files (tokenizer.json, tokenizer_config.json, ...): the rows of "
            f"'{names[0]}' ({other + ', the base ' if other else 'the base has '}{base_rows}) are matched by token, "
            "which needs the base's tokenizer; give the base as its model folder with its tokenizer"
        )
    return read


def _check_fits(vocab: TokenVocabulary, label: str, rows: int, name: str) -> None:
    if vocab.size > rows:
        token, i = max(vocab.ids.items(), key=lambda item: item[1])
        raise SourceError(
            f"{label}: its tokenizer has token {token!r} at id {i} but '{name}' has only {rows} rows: the tokenizer "
            "does not belong to these weights (resize_token_embeddings after adding tokens?)"
        )


def _compare(base: TokenVocabulary, vocab: TokenVocabulary, label: str) -> dict[str, Any]:
    """How an expert's tokens differ from the base's: base tokens it lacks or has at another id, and ids where it
    has another token than the base (renamed, e.g. a reserved token turned into a tool token). Refuses a tokenizer
    that lacks most of the base's tokens (another tokenizer, not the base's with tokens added)."""
    if vocab is base:
        return {}
    by_id = {i: t for t, i in vocab.ids.items()}
    lacks = [t for t in base.ids if t not in vocab.ids]
    if len(lacks) > MOST_MISSING * len(base.ids):
        raise SourceError(
            f"{label}: its tokenizer lacks {len(lacks)} of the base's {len(base.ids)} tokens (e.g. {lacks[0]!r}): "
            "it is another tokenizer, not the base's with tokens added; merge only experts fine-tuned from this base"
        )
    renamed = [{"id": base.ids[t], "base": t, "expert": by_id[base.ids[t]]} for t in lacks if base.ids[t] in by_id]
    moved = sum(1 for t, i in base.ids.items() if vocab.ids.get(t, i) != i)
    return {"lacks_base_tokens": len(lacks), "moved_base_tokens": moved, "renamed": renamed[:SHOWN]}


def _output_vocabulary(
    source: str,
    chosen: int | None,
    base_tokenizer: Any,
    base: TokenVocabulary,
    vocabs: Sequence[TokenVocabulary],
    keys: Sequence[str],
) -> tuple[VocabularyPlan, TokenVocabulary]:
    """The output's tokenizer and vocabulary: the chosen expert's (its tokenizer folder is set by the caller), the
    base's, or the union (the base tokenizer with every token an expert added, in expert order, each once)."""
    if chosen is not None:
        return VocabularyPlan(source, None, None), vocabs[chosen]
    if source == "base":
        return VocabularyPlan(source, None, None), base
    added: dict[str, Mapping[str, bool]] = {}
    for vocab, key in zip(vocabs, keys, strict=True):
        for token in sorted((t for t in vocab.ids if t not in base.ids), key=vocab.ids.__getitem__):
            if token not in vocab.added:
                raise SourceError(
                    f"expert '{key}': its tokenizer has the vocabulary entry {token!r}, which the base's lacks and "
                    "which is not an added token: another tokenizer, not the base's with tokens added; use "
                    f"tokenizer_source: {key} to take that expert's tokenizer, or base"
                )
            added.setdefault(token, vocab.added[token])
    if not added:
        return VocabularyPlan(source, None, None), base
    return VocabularyPlan(source, None, None, base_tokenizer), add_tokens(base_tokenizer, list(added.items()))


def _token_notes(
    out: TokenVocabulary, base: TokenVocabulary, vocabs: Sequence[TokenVocabulary], keys: Sequence[str]
) -> dict[str, list[dict[str, Any]]]:
    """The report's lists: ``added``, every output token the base lacks (its output id, and the experts that have
    it with its id in each: their rows are averaged); ``dropped``, tokens of experts the output lacks; ``clashes``,
    rows that experts use for different added tokens (each token keeps its own output row)."""

    def holders(token: str) -> dict[str, int]:
        return {key: vocab.ids[token] for key, vocab in zip(keys, vocabs, strict=True) if token in vocab.ids}

    added = []
    for token in sorted((t for t in out.ids if t not in base.ids), key=out.ids.__getitem__):
        flags = out.added.get(token, {})
        added.append({"token": token, "id": out.ids[token], "from": holders(token), "special": flags.get("special")})
    seen = {t for vocab in vocabs for t in vocab.ids if t not in out.ids}
    dropped = [{"token": t, "from": holders(t)} for t in sorted(seen)]
    rows: dict[int, dict[str, str]] = {}
    for key, vocab in zip(keys, vocabs, strict=True):
        for token, i in vocab.ids.items():
            if token not in base.ids:
                rows.setdefault(i, {})[key] = token
    clashes = [{"row": i, "tokens": used} for i, used in sorted(rows.items()) if len(set(used.values())) > 1]
    return {"added": added, "dropped": dropped, "clashes": clashes}
