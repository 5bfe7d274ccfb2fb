"""A merge's inputs: found (local paths or hub ids), opened, and refused where they overlap each other or the output.

:func:`resolve_inputs` finds each spec's files (:func:`~specmerge.io.hub.ids.resolve_input`: a local path, or a
Hugging Face hub id's cache snapshot). :func:`open_inputs` opens the base
(:func:`~specmerge.io.formats.sources.open_source`) and every expert (:func:`~specmerge.io.views.experts.open_expert`: a
checkpoint or a PEFT adapter) from there, then refuses an expert that is the base or another expert
(:func:`refuse_duplicate_inputs`) and an output that is, holds or lies inside an input
(:func:`refuse_output_inside_inputs`), comparing the files really read, links resolved. What is written next to
a merge names its inputs portably (:func:`portable_spec`): hub ids pinned to the commit read, local paths
relative to the output folder.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from specmerge.errors import RecipeError
from specmerge.io.formats.protocol import TensorSource
from specmerge.io.formats.sources import open_source
from specmerge.io.hub.ids import InputResolution, is_hub_spec, resolve_input
from specmerge.io.output.folder import OutputError
from specmerge.io.views.experts import Expert, open_expert
from specmerge.pipeline.recipe.model import Recipe


def resolve_inputs(base: str, experts: Sequence[str]) -> list[InputResolution]:
    """Where the base and each expert are read from (base first): local paths, or hub ids' cache snapshots."""
    return [resolve_input(spec) for spec in [base, *experts]]


def open_inputs(
    stack: ExitStack,
    base: str,
    experts: Sequence[str],
    output: str | os.PathLike | None,
    resolved: Sequence[InputResolution] | None = None,
) -> tuple[TensorSource, list[Expert]]:
    """Open ``base`` and ``experts`` (closed when ``stack`` closes) from where they resolve (``resolved``, from
    :func:`resolve_inputs`; resolved here when None), checked against each other and ``output`` (None: nothing
    is written, as in a dry run)."""
    resolved = resolve_inputs(base, experts) if resolved is None else resolved
    paths = [r.path for r in resolved]
    base_source = stack.enter_context(open_source(paths[0]))
    opened = [stack.enter_context(open_expert(path, base_source.infos(), base_source)) for path in paths[1:]]
    refuse_duplicate_inputs([base, *experts], [base_source, *opened])
    if output is not None:
        refuse_output_inside_inputs(Path(output), [str(p) for p in paths], [base_source, *opened])
    return base_source, opened


def portable_spec(resolution: InputResolution, output: str | os.PathLike, *, pinned: bool = True) -> str:
    """How files written into ``output`` name an input: a hub id (``org/name@<commit>`` when ``pinned``, else
    ``org/name``), or the local path relative to the output folder, never an absolute path."""
    if resolution.origin == "hub":
        return resolution.pinned if pinned else str(resolution.repo_id)
    return os.path.relpath(os.path.abspath(resolution.path), os.path.abspath(output))


def refuse_output_inside_inputs(output: Path, inputs: Sequence[str], sources: Sequence[Any] = ()) -> None:
    """Refuse an output that is, holds or lies inside an input, so that replacing it can never delete an input.

    Compares the real paths (links resolved) of the output and of the typed ``inputs`` (hub ids left out: their
    snapshots are checked once resolved) and, given the opened ``sources`` (one per input, in order), of every
    file they read: a file reached through a link counts where it really lies.
    """
    target = Path(os.path.realpath(output))  # never raises, even for a symbolic link loop
    for path in inputs:
        if is_hub_spec(path):
            continue
        source = Path(os.path.realpath(path))
        if target == source or source in target.parents or target in source.parents:
            raise OutputError(f"output '{output}' overlaps the input '{path}': choose a separate output folder")
    for path, source in zip(inputs, sources, strict=False):
        for file in source.files():
            if file == target or target in file.parents:
                raise OutputError(
                    f"output '{output}' holds {file}, which the input '{path}' reads (through a link): "
                    "choose a separate output folder"
                )


def refuse_duplicate_inputs(inputs: Sequence[str], sources: Sequence[Any]) -> None:
    """Refuse an expert that reads the same files as the base or as another expert.

    ``inputs`` are the base and then the experts, ``sources`` the opened ones in the same order. Files are
    compared as the files really read (device and inode), so a link, a hard link, or a folder given once as
    a folder and once as its own weights file are all found.
    """
    seen: dict[frozenset, int] = {}
    for i, source in enumerate(sources):
        files = source.files()
        key = frozenset(file_identity(f) for f in files)
        first = seen.setdefault(key, i)
        if first == i:
            continue
        shown = f"{files[-1]}" + (f" and {len(files) - 1} more" if len(files) > 1 else "")
        if first == 0:
            raise RecipeError(
                f"expert '{inputs[i]}' is the base model '{inputs[0]}' (both read {shown}): an expert is a "
                "fine-tuned copy of the base; remove it from the experts",
                ("experts", i - 1),
            )
        raise RecipeError(
            f"experts '{inputs[first]}' and '{inputs[i]}' are the same checkpoint (both read {shown}): "
            "list each expert once",
            ("experts", i - 1),
        )


def file_identity(path: Path) -> tuple[int, int] | str:
    """What tells a file from every other: its device and inode (its path when it cannot be read)."""
    try:
        info = os.stat(path)
    except OSError:
        return str(path)
    return info.st_dev, info.st_ino


def input_notes(
    recipe: Recipe, resolved: Sequence[InputResolution], output: str | os.PathLike | None
) -> list[dict[str, Any]]:
    """report.json's account of the inputs, base first: role, expert key, the name files in the output use for
    it (:func:`portable_spec`; the spec as given when there is no output) and where it came from."""
    keys = [None, *(recipe.expert_keys or [])]
    notes = []
    for i, (key, resolution) in enumerate(zip(keys, resolved, strict=True)):
        name = resolution.spec if output is None else portable_spec(resolution, output)
        note = {"role": "expert" if i else "base", **({"key": key} if key else {}), "name": name}
        notes.append({**note, **resolution.as_dict()})
    return notes


def portable_recipe(
    recipe: Recipe,
    resolved: Sequence[InputResolution],
    output: str | os.PathLike,
    layer_inputs: Mapping[str, InputResolution] | None = None,
) -> Recipe:
    """``recipe`` as written into ``output``: its base, experts and the models of its ``layers`` (found where
    ``layer_inputs`` says, by spec) named by :func:`portable_spec` (hub ids pinned to the commit read, local paths
    relative to the output folder); ``load_recipe`` of the written file gives the same inputs from any working
    folder. Expert keys stay as they are (the written recipe states them). The executor is left out (``local``): it
    does not change the output, and a cluster's address is no part of the model."""
    names = [portable_spec(r, output) for r in resolved]
    update: dict[str, Any] = {"base": names[0], "experts": names[1:], "executor": "local", "address": None}
    if recipe.layers is not None and layer_inputs is not None:
        update["layers"] = [
            r.model_copy(update={"model": portable_spec(layer_inputs[r.model], output)}) for r in recipe.layers
        ]
    return recipe.model_copy(update=update)
