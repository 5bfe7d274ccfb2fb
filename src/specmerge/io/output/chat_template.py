"""The merged model's chat template: chosen from the inputs before any tensor is read, said on the console, written.

Instruct experts fine-tuned from a base model usually carry a chat template the base lacks. A merge that copied the
base's tokenizer files alone would give a model without one, silently. So (``chat_template`` in a recipe,
``--chat-template``):

- ``None`` / ``auto`` (default): the experts' template when every expert that has one has the same one (the base's
  when no expert has one). Experts with different templates are refused before the merge, in one line naming two
  of them, with what to write instead.
- ``base``: the base's (or none, if it has none); an expert's name: that expert's.
- a path to a file: its text (a ``.jinja`` template, or a ``.json`` file with a ``chat_template`` key, as
  Hugging Face folders store them); a text with ``{{`` or ``{%`` in it: that template itself.

A folder's template is read from ``chat_template.jinja``, else ``chat_template.json``, else ``tokenizer_config.json``'s
``chat_template`` (a string, or a list of named templates), from the files :func:`tokenizer_files` lists (regular
files inside the folder, never followed out of it through a link). The output gets the chosen template in the place
transformers reads first: ``chat_template.jinja`` for one template (the other two places are cleared of theirs so
that none contradicts it), ``tokenizer_config.json`` for a list.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specmerge.errors import RecipeError
from specmerge.io.formats.files import read_json, write_json
from specmerge.io.output.folder import OUTPUT_LOG
from specmerge.io.output.model_files import tokenizer_files

JINJA, JSON_FILE, TOKENIZER_CONFIG = "chat_template.jinja", "chat_template.json", "tokenizer_config.json"
MAX_BYTES = 2**20  # a chat template is a few kB; a larger file is not one
Template = str | list[Any] | None


@dataclass(frozen=True)
class ChosenTemplate:
    """The template the output carries (None: none) and where it comes from, as the console says it."""

    template: Template
    source: str


def read_template(folder: Path) -> Template:
    """The chat template a model folder carries (None: none, or ``folder`` is a single weights file)."""
    files = tokenizer_files(folder) if folder.is_dir() else {}
    if JINJA in files:
        return _text(files[JINJA], folder / JINJA)
    for name in (JSON_FILE, TOKENIZER_CONFIG):
        if name in files:
            data = read_json(files[name])
            found = data.get("chat_template") if isinstance(data, dict) else None
            if isinstance(found, str | list) and found:
                return found
    return None


def choose_template(choice: str | None, base: Path, experts: Sequence[Path], keys: Sequence[str]) -> ChosenTemplate:
    """The template ``choice`` gives for these inputs (see the module docstring); a :class:`RecipeError` in one line
    for experts that disagree under ``auto``, or a choice that names nothing."""
    if choice is None or choice == "auto":
        return _automatic(base, experts, keys)
    if choice == "base":
        return ChosenTemplate(read_template(base), "the base's")
    if choice in keys:
        return ChosenTemplate(read_template(experts[list(keys).index(choice)]), f"expert '{choice}''s")
    if "{{" in choice or "{%" in choice:
        return ChosenTemplate(choice, "the recipe's chat_template text")
    path = Path(choice).expanduser()
    if not path.is_file():
        raise RecipeError(
            f"chat_template '{choice}' is not auto, base, an expert's name ({', '.join(keys)}), a file or a template "
            "text: specmerge has no built-in templates; give the path of a .jinja file",
            ("chat_template",),
        )
    if path.suffix == ".json":
        data = read_json(path)
        found = data.get("chat_template") if isinstance(data, dict) else None
        if not isinstance(found, str | list) or not found:
            raise RecipeError(f"chat_template file {path} holds no 'chat_template' key", ("chat_template",))
        return ChosenTemplate(found, f"the file {path}")
    return ChosenTemplate(_text(path, path), f"the file {path}")


def _automatic(base: Path, experts: Sequence[Path], keys: Sequence[str]) -> ChosenTemplate:
    carried = {key: t for key, path in zip(keys, experts, strict=True) if (t := read_template(path)) is not None}
    if not carried:
        found = read_template(base)
        return ChosenTemplate(found, "the base's" if found is not None else "none")
    distinct = list(dict.fromkeys(_canonical(t) for t in carried.values()))
    if len(distinct) > 1:
        first = next(k for k, t in carried.items() if _canonical(t) == distinct[0])
        other = next(k for k, t in carried.items() if _canonical(t) == distinct[1])
        raise RecipeError(
            f"experts '{first}' and '{other}' carry different chat templates: choose the merged model's with "
            "chat_template / --chat-template (base, an expert's name, or a path to a .jinja file)",
            ("chat_template",),
        )
    template = next(iter(carried.values()))
    lacking = [k for k in keys if k not in carried]
    same_as_base = _canonical(read_template(base)) == distinct[0]
    source = "the experts' (all carry the same)"
    if lacking:
        source = f"the experts' ({', '.join(carried)}; none in {', '.join(lacking)})"
    return ChosenTemplate(template, source + (", the base's too" if same_as_base else ""))


def apply_template(folder: Path, chosen: ChosenTemplate) -> None:
    """Make the tokenizer files written into ``folder`` carry ``chosen``'s template, and say which it is."""
    if chosen.template is None and chosen.source == "none":
        return  # no input has one: nothing to say or write
    logging.getLogger(OUTPUT_LOG).info(f"chat template: {chosen.source}")
    if _canonical(read_template(folder)) == _canonical(chosen.template):
        return
    (folder / JINJA).unlink(missing_ok=True)
    (folder / JSON_FILE).unlink(missing_ok=True)
    config = read_json(folder / TOKENIZER_CONFIG)
    if isinstance(config, dict) and "chat_template" in config:
        del config["chat_template"]
        write_json(folder / TOKENIZER_CONFIG, config, indent=2)
    if isinstance(chosen.template, str):
        (folder / JINJA).write_text(chosen.template, encoding="utf-8")
    elif chosen.template is not None:  # named templates: only tokenizer_config.json holds a list
        config = config if isinstance(config, dict) else {}
        write_json(folder / TOKENIZER_CONFIG, {**config, "chat_template": chosen.template}, indent=2)


def _text(real: Path, shown: Path) -> str:
    if real.stat().st_size > MAX_BYTES:
        raise RecipeError(f"{shown} is over {MAX_BYTES // 1024} KiB: not a chat template", ("chat_template",))
    return real.read_text(encoding="utf-8")


def _canonical(template: Template) -> str | None:
    return None if template is None else json.dumps(template, sort_keys=True)
