"""The files of ``specmerge adamerge``: its data (texts or token ids), the model folders read, the folder written.

The data is a text file (one input per line, blank lines skipped), a ``.jsonl`` file with a ``"text"`` (or,
for a model without a tokenizer, an ``"input_ids"``) field on every line, or a Python iterable of batches ready
for the model. Texts are tokenized with the merged folder's tokenizer (its eos token pads when it has no pad
token). The merged folder is loaded with transformers (offline, no remote code); the output folder gets the
merged folder's config and tokenizer files, the adapted weights and ``adamerge.json``, written atomically.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specmerge.errors import RecipeError, SpecmergeError
from specmerge.io.formats.files import write_json
from specmerge.io.formats.protocol import SourceError, TensorInfo
from specmerge.io.formats.sources import open_source
from specmerge.io.hub.ids import InputResolution, resolve_input
from specmerge.io.output.folder import atomic_directory, check_output
from specmerge.io.output.model_files import copy_config_files, copy_tokenizer_files, write_output_config
from specmerge.io.output.tokenizers import read_tokenizer, transformers_module
from specmerge.io.output.writer import ShardWriter
from specmerge.pipeline.inputs.open import portable_spec, refuse_output_inside_inputs
from specmerge.pipeline.recipe.values import check_device
from specmerge.pipeline.run.compute import resolve_device
from specmerge.version import __version__

TASKS = {"causal-lm": "AutoModelForCausalLM", "classification": "AutoModelForSequenceClassification"}
REPORT_FILE = "adamerge.json"
ADAMERGING_CITATION = "Yang et al., AdaMerging: Adaptive Model Merging for Multi-Task Learning, ICLR 2024"


def check_data_settings(task: str, batch_size: int, max_length: int) -> None:
    """One line for a task, batch size or maximum length that cannot be used."""
    if task not in TASKS:
        raise RecipeError(f"unknown task {task!r}: choose {' or '.join(TASKS)}", ("task",))
    for key, value in (("batch_size", batch_size), ("max_length", max_length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RecipeError(f"{key} must be a whole number >= 1, got {value!r}", (key,))


def adamerge_device(device: str) -> torch.device:
    """The device AdaMerging runs on, or a one-line error (a name no recipe takes, or CUDA asked for and absent)."""
    check_device(device)
    try:
        return resolve_device(device)
    except ValueError as err:
        raise RecipeError(str(err), ("device",)) from None


def is_data_file(data: Any) -> bool:
    return isinstance(data, str | os.PathLike)


def read_examples(path: str | os.PathLike) -> list[str] | list[list[int]]:
    """The inputs of a data file: texts, or token ids (``.jsonl`` lines with ``input_ids``); one line each."""
    path = Path(path)
    hint = 'give a text file (one input per line) or a .jsonl file with a "text" field per line'
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise SpecmergeError(f"data file {path} does not exist: {hint}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise SpecmergeError(f"data file {path} cannot be read as UTF-8 text ({err}): {hint}") from None
    numbered = [(k + 1, line) for k, line in enumerate(lines) if line.strip()]
    if not numbered:
        raise SpecmergeError(f"data file {path} holds no input (it is empty or blank): {hint}")
    if path.suffix != ".jsonl":
        return [line for _, line in numbered]
    examples = [_json_example(path, number, line) for number, line in numbered]
    if len({type(e) for e in examples}) > 1:
        raise SpecmergeError(f'data file {path} mixes "text" and "input_ids" lines: use one kind throughout')
    return examples


def _json_example(path: Path, number: int, line: str) -> str | list[int]:
    try:
        row = json.loads(line)
    except ValueError as err:
        raise SpecmergeError(f"data file {path}, line {number}: not valid JSON ({err})") from None
    if isinstance(row, dict) and isinstance(row.get("text"), str):
        return row["text"]
    ids = row.get("input_ids") if isinstance(row, dict) else None
    if isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        return ids
    raise SpecmergeError(
        f'data file {path}, line {number}: expected an object with a "text" string or a non-empty "input_ids" list '
        "of token ids"
    )


Shapes = Mapping[str, tuple[int, ...]]


def check_shapes(base: Shapes, merged: Shapes, experts: Sequence[Shapes] = (), names: Iterable[str] = ()) -> None:
    """One line for a merged model whose tensor names or shapes are not the base's, or an expert that lacks one of
    ``names`` or has it in another shape (expert i named by its position, from 0)."""
    extra, lacking = sorted(set(merged) - set(base)), sorted(set(base) - set(merged))
    if extra or lacking:
        name, has, lacks = (extra[0], "merged model", "base") if extra else (lacking[0], "base", "merged model")
        raise SpecmergeError(
            f"tensor '{name}' is in the {has} but not in the {lacks} ({len(extra) + len(lacking)} names differ): the "
            "merged model must be a merge of this base, with the same tensor names"
        )
    for name, shape in merged.items():
        if tuple(shape) != tuple(base[name]):
            raise SpecmergeError(
                f"tensor '{name}' is {tuple(shape)} in the merged model but {tuple(base[name])} in the base: the "
                "merged model must be a merge of this base"
            )
    for i, expert in enumerate(experts):
        for name in names:
            if name not in expert or tuple(expert[name]) != tuple(base[name]):
                shape = "lacks it" if name not in expert else f"has {tuple(expert[name])}"
                raise SpecmergeError(
                    f"expert {i}: tensor '{name}' is {tuple(base[name])} in the base but the expert {shape}: every "
                    "expert must be a fine-tuned copy of the base"
                )


def changed_tensors(
    base: Mapping[str, torch.Tensor], merged: Mapping[str, torch.Tensor], experts: Sequence[Mapping[str, torch.Tensor]]
) -> list[str]:
    """The names of the floating tensors the merge changed, after :func:`check_shapes` (experts on those names)."""
    shapes = [{name: tuple(t.shape) for name, t in state.items()} for state in (base, merged, *experts)]
    check_shapes(shapes[0], shapes[1])
    changed = [
        name
        for name, value in merged.items()
        if value.is_floating_point() and not torch.equal(value, base[name].to(value.dtype))
    ]
    check_shapes(shapes[0], shapes[1], shapes[2:], changed)
    return changed


def make_batches(
    examples: list[str] | list[list[int]], folder: Path, model: Any, batch_size: int, max_length: int
) -> list[dict[str, torch.Tensor]]:
    """Batches of ``batch_size`` examples (right-padded, cut at ``max_length`` tokens, with an attention mask);
    texts are tokenized with ``folder``'s tokenizer. The model's config gets the pad token id if it has none."""
    config = model.config
    if isinstance(examples[0], str):
        tokenizer = _tokenizer(folder)
        batches = [
            dict(tokenizer(examples[i : i + batch_size], padding=True, truncation=True, max_length=max_length,
                           return_tensors="pt"))
            for i in range(0, len(examples), batch_size)
        ]  # fmt: skip
        pad = tokenizer.pad_token_id
    else:
        given = (getattr(config, "pad_token_id", None), _first(getattr(config, "eos_token_id", None)))
        pad = next((i for i in given if i is not None), 0)
        vocab = getattr(config, "vocab_size", None)
        too_large = next((i for ids in examples for i in ids if vocab is not None and i >= vocab), None)
        if too_large is not None:
            raise SpecmergeError(f"token id {too_large} in the data is outside the model's vocabulary of {vocab}")
        batches = [_padded(examples[i : i + batch_size], pad, max_length) for i in range(0, len(examples), batch_size)]
    if getattr(config, "pad_token_id", None) is None:
        config.pad_token_id = pad  # sequence classifiers find each input's last token by it
    return batches


def _first(value: int | list[int] | None) -> int | None:
    return value[0] if isinstance(value, list) and value else value if isinstance(value, int) else None


def _padded(rows: list[list[int]], pad: int, max_length: int) -> dict[str, torch.Tensor]:
    rows = [ids[:max_length] for ids in rows]
    width = max(len(ids) for ids in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for k, ids in enumerate(rows):
        input_ids[k, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        mask[k, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask}


def _tokenizer(folder: Path) -> Any:
    found = read_tokenizer(folder, "the merged model")
    if found is None:
        raise SpecmergeError(
            f"the merged model {folder} has no tokenizer files to tokenize the texts: copy the base's tokenizer "
            'into it, or give token ids (a .jsonl file with an "input_ids" list per line)'
        )
    tokenizer = found[0]
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise SpecmergeError(
                f"the tokenizer of {folder} has neither a pad nor an eos token to pad batches with: add a pad token "
                'to its tokenizer files, or give token ids (a .jsonl file with an "input_ids" list per line)'
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@dataclass
class Folders:
    """The opened inputs: where each was found (base, merged, experts) and their tensors' infos."""

    resolved: list[InputResolution]
    infos: list[dict[str, TensorInfo]]
    sources: list[Any]

    @property
    def merged_path(self) -> Path:
        return self.resolved[1].path

    def state(self, k: int) -> dict[str, torch.Tensor]:
        """Every tensor of input ``k`` (0: base, 1: merged, 2...: experts), in its stored dtype."""
        return {name: self.sources[k].load(name) for name in self.infos[k]}


def open_folders(
    stack: ExitStack,
    base: str | os.PathLike,
    merged: str | os.PathLike,
    experts: Sequence[str | os.PathLike],
    output: Path,
    overwrite: bool,
    data: Any,
) -> Folders:
    """Find and open base, merged and experts (closed with ``stack``); refuse an output that overlaps an input
    (or the data file) or that exists without ``overwrite``, before any work."""
    specs = [os.fspath(p) for p in [base, merged, *experts]]
    data_files = [os.fspath(data)] if is_data_file(data) else []
    refuse_output_inside_inputs(output, [*specs, *data_files])
    check_output(output, overwrite)
    resolved = [resolve_input(spec) for spec in specs]
    sources = [stack.enter_context(open_source(r.path)) for r in resolved]
    refuse_output_inside_inputs(output, [str(r.path) for r in resolved], sources)
    infos = [source.infos() for source in sources]
    shapes = [{name: info.shape for name, info in found.items()} for found in infos]
    check_shapes(shapes[0], shapes[1], shapes[2:], shapes[0])  # before any tensor is read
    return Folders(resolved, infos, sources)


def load_model(folder: Path, task: str) -> Any:
    """The model of ``folder`` for ``task``, in float32, in eval mode (transformers, offline, no remote code)."""
    transformers = transformers_module("specmerge adamerge")
    cls = getattr(transformers, TASKS[task])
    try:
        model = cls.from_pretrained(folder, dtype=torch.float32, local_files_only=True, trust_remote_code=False)
    except Exception as err:  # transformers raises many kinds; any of them means "cannot be loaded for this task"
        reason = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise SourceError(
            f"transformers cannot load {folder} as {TASKS[task]} ({type(err).__name__}: {reason[:300]}); check the "
            "folder's config.json and --task"
        ) from None
    return model.eval()


def refuse_model_mismatch(model: Any, merged: Iterable[str], task: str) -> None:
    """Refuse a model whose parameters the merged checkpoint lacks: transformers gave them random values."""
    names = set(merged)
    lacking = sorted(name for name, _ in model.named_parameters() if name not in names)
    if lacking:
        raise SpecmergeError(
            f"the merged checkpoint has no tensor '{lacking[0]}' ({len(lacking)} in all) that {TASKS[task]} needs, "
            "so transformers initialised it at random: for --task classification merge classifiers (with their "
            "heads), for causal-lm merge language models"
        )


def input_names(folders: Folders, output: Path, data: Any) -> dict[str, Any]:
    """adamerge.json's names of the inputs: as recipe.yaml names them (hub ids pinned, paths relative to output)."""
    names = [portable_spec(r, output) for r in folders.resolved]
    shown = os.path.relpath(os.path.abspath(data), os.path.abspath(output)) if is_data_file(data) else "batches"
    return {"base": names[0], "merged": names[1], "experts": names[2:], "data": shown}


def adamerge_report(result: Any, inputs: dict, settings: dict, batches: int, started: float) -> dict[str, Any]:
    """adamerge.json: the inputs, settings, entropies, coefficients, groups and losses of an ``AdaMergeResult``."""
    return {
        "specmerge": __version__,
        "method": "adamerge",
        "citation": ADAMERGING_CITATION,
        "inputs": inputs,
        "settings": settings,
        "batches": batches,
        "entropy_start": result.entropy_start,
        "entropy_end": result.entropy_end,
        "coefficients": result.coefficients,
        "expert_coefficients": result.expert_coefficients,
        "groups": result.groups,
        "losses": result.losses,
        "seconds": round(time.perf_counter() - started, 3),
    }


def write_adamerged(
    output: Path, overwrite: bool, folders: Folders, state: Mapping[str, torch.Tensor], report: dict
) -> None:
    """Write ``output`` atomically: the adapted weights (the merged folder's names, order and dtypes), the merged
    folder's config and tokenizer files and ``adamerge.json``."""
    infos = [TensorInfo(name, info.shape, info.dtype) for name, info in folders.infos[1].items()]
    with atomic_directory(output, overwrite=overwrite, expected_bytes=sum(i.nbytes for i in infos)) as folder:
        metadata = {"merged_with": f"specmerge {__version__}", "method": "adamerge"}
        with ShardWriter(folder, infos, metadata=metadata) as writer:
            for info in infos:
                writer.write(info.name, state[info.name].contiguous())
        copy_config_files(folders.merged_path, folder)
        copy_tokenizer_files(folders.merged_path, folder)
        write_output_config(folder, infos)
        write_json(folder / REPORT_FILE, report)
