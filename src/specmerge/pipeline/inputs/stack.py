"""A frankenmerge's inputs: the models of a recipe's ``layers`` opened, and their layers stacked into the source the
plan copies from (:mod:`specmerge.io.views.stacked`; the recipe side: :mod:`specmerge.pipeline.recipe.frankenmerge`)."""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path

from specmerge.io.formats.protocol import SourceError, TensorSource
from specmerge.io.formats.sources import open_source
from specmerge.io.hub.ids import InputResolution, resolve_input
from specmerge.io.views.stacked import StackedSource, stack_layers
from specmerge.pipeline.inputs.open import refuse_output_inside_inputs
from specmerge.pipeline.recipe.model import Recipe


def stacked_inputs(
    stack: ExitStack, recipe: Recipe, base: TensorSource, base_path: Path, output: str | os.PathLike | None
) -> tuple[StackedSource, int, dict[str, InputResolution]]:
    """The stacked layers of ``recipe.layers`` as one source (each model opened once, the base's own source reused
    for the base), the output's layer count and where each model was found (by its spec in the recipe); an output
    inside a model is refused (None: a dry run)."""
    specs = list(dict.fromkeys(r.model for r in recipe.layers or ()))
    sources: dict[str, TensorSource] = {}
    found = {spec: resolve_input(spec) for spec in specs}
    for spec, resolution in found.items():
        same = os.path.realpath(resolution.path) == os.path.realpath(base_path)
        sources[spec] = base if same else stack.enter_context(open_source(resolution.path))
    if output is not None:
        refuse_output_inside_inputs(Path(output), [str(r.path) for r in found.values()], list(sources.values()))
    slices = [(r.model, r.range[0], r.range[1]) for r in recipe.layers or ()]
    try:
        names = stack_layers({spec: source.infos() for spec, source in sources.items()}, slices)
    except SourceError as err:
        raise SourceError(f"layers: {err}") from None
    return StackedSource(sources, names, base_path), sum(stop - start for _, start, stop in slices), found
