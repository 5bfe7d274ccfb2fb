"""The vocabulary stage of a merge: experts with added tokens, their embedding rows matched by token string.

:func:`vocabulary_stage` runs inside the alignment stage (:func:`specmerge.pipeline.inputs.align.align_inputs`), when
the inputs are in the output's tensor names and before the experts' own modules are added. It applies the
recipe's ``tokenizer_source`` (:mod:`specmerge.pipeline.recipe.tokenizer_source`) through
:func:`specmerge.io.views.vocab.align_vocabulary`, which says what is matched and how, and gives the
:class:`~specmerge.io.views.vocab.VocabularyPlan` that the writer follows (which tokenizer the output gets, how many
rows ``config.json`` states) and whose notes go into report.json under ``vocabulary``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from specmerge.io.formats.protocol import TensorInfo, TensorSource
from specmerge.io.views.experts import Expert
from specmerge.io.views.vocab import VocabularyPlan, align_vocabulary
from specmerge.methods import get_method
from specmerge.pipeline.plan.rules import default_action
from specmerge.pipeline.recipe.model import Recipe
from specmerge.pipeline.recipe.tokenizer_source import tokenizer_index


def vocabulary_stage(
    recipe: Recipe,
    base: TensorSource,
    experts: Sequence[Expert],
    base_path: Path,
    expert_paths: Sequence[Path],
) -> tuple[TensorSource, list[Expert], VocabularyPlan]:
    """The base and experts with their token embeddings and heads in the output vocabulary's rows (views; the
    inputs themselves when nothing needs matching), and the output vocabulary's plan."""
    keys = list(recipe.expert_keys or [])
    source = tokenizer_index(recipe.tokenizer_source, recipe.experts, keys)
    return align_vocabulary(
        base,
        experts,
        base_path=Path(base_path),
        expert_paths=[Path(p) for p in expert_paths],
        keys=keys,
        tokenizer_source=source,
        kept_from_base=kept_from_base(recipe, base.infos()),
    )


def kept_from_base(recipe: Recipe, base: Mapping[str, TensorInfo]) -> Callable[[str], bool]:
    """Whether the plan will keep base tensor ``name`` from the base: the first override that matches it says
    so, or, without one, the recipe's rule for its kind (:func:`specmerge.pipeline.plan.rules.default_action`)."""
    method = get_method(recipe.method)

    def kept(name: str) -> bool:
        info = base[name]
        for override in recipe.overrides:
            if fnmatch.fnmatchcase(name, override.pattern):
                return override.action == "keep_base"
        return default_action(name, info.shape, info.dtype, method, recipe)[0] == "keep_base"

    return kept
