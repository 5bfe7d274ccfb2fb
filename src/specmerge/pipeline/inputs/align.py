"""The alignment stage of a merge: every input in the output's tensor names, and the experts' own modules.

:func:`align_inputs` runs after the inputs are opened and before the plan is made
(:func:`~specmerge.pipeline.plan.prepare.prepare_merge`). It turns the opened base and experts into lazy views
(:mod:`specmerge.io.views.aligned`) that share one set of names, so that the plan, the work items, the executor and
the arithmetic are those of an ordinary merge:

1. **The output's names** are those of the ``config_source`` input (the base by default, or an expert): the
   output gets that input's ``config.json`` and processor files, and its tensor names.
2. **Names.** Each input's names are mapped into the output's (:func:`specmerge.io.views.name_map.find_name_map`:
   exact names, then prefix rewrites such as ``'bert.' -> ''`` found from names and shapes). A map that
   matches fewer than half of the tensors the two checkpoints could share (a different architecture) is
   refused. LoRA adapters name the base's tensors (PEFT maps its wrapper away) and take the base's map.
3. **Vocabulary** (:func:`specmerge.pipeline.inputs.vocabulary.vocabulary_stage`): experts with added tokens; the
   rows of token embeddings and heads matched by token string, following the recipe's ``tokenizer_source``.
4. **Own modules**: the tensors some experts hold and the base (in the output's names) lacks, a vision tower,
   a projector, a task head. Each is taken from the experts that hold it: the one holder's tensor exactly, or
   the plain average of several holders (which needs equal shapes), unless the recipe's ``modules`` names the
   source (an expert, or ``drop``) for a pattern of names. The base view (:class:`~specmerge.io.views.aligned
   .OwnModulesSource`) serves them and the plan keeps them "from the base" with the reason ``own module of
   expert 'a'``, so an expert that lacks a module is never read for it. Own modules are found by name only: an
   embedding with more rows is a shared tensor, not an own module.
5. **Dropped**: tensors of the base that the output's names lack (the chosen config has no such module, e.g.
   a head of the base that the config_source expert's architecture does not have) are left out, and so are
   the experts' tensors of those names; the report lists them.

A :class:`AlignedInputs` carries the views, the folder of the output's config, the own modules' plan reasons
and the report notes: ``config_source``, ``names`` (each renamed input's map: ``{"exact": 2, "'bert.' ->
''": 197, "unmatched": 2}``), ``modules`` (each kept module: tensors, the experts it came from, copied or
averaged, whether the output's config has it) and ``dropped``.
"""

from __future__ import annotations

import fnmatch
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specmerge.errors import SpecmergeError, closest_name
from specmerge.io.formats.layout import config_file
from specmerge.io.formats.protocol import TensorInfo, TensorSource
from specmerge.io.views.aligned import OwnModulesSource, OwnTensor, RenamedExpert, RenamedSource, average_dtype
from specmerge.io.views.experts import Expert
from specmerge.io.views.name_map import NameMap, find_name_map, identity_map
from specmerge.io.views.vocab import VocabularyPlan
from specmerge.pipeline.inputs.vocabulary import vocabulary_stage
from specmerge.pipeline.recipe.input_choice import DROP, input_index
from specmerge.pipeline.recipe.model import Recipe

LOG = logging.getLogger("specmerge.inputs")
MIN_MATCHED_SHARE = 0.5  # a name map must match at least this share of the tensors two checkpoints could share


class AlignError(SpecmergeError):
    """The inputs cannot be put in one set of names, or an own module has no single source."""


@dataclass
class AlignedInputs:
    """The inputs of a merge in the output's tensor names (see the module docstring)."""

    base: TensorSource  # the base's tensors kept in the output, then the own modules, in the output's order
    experts: list[Expert]  # in the output's names, without dropped tensors
    config_path: Path  # the folder (or file) whose config.json and processor files the output gets
    own: dict[str, str] = field(default_factory=dict)  # own-module tensor -> the plan's reason
    notes: dict[str, Any] = field(default_factory=dict)
    vocabulary: VocabularyPlan | None = None  # the output's vocabulary and tokenizer (None: the base's)


def align_inputs(
    recipe: Recipe,
    base: TensorSource,
    experts: Sequence[Expert],
    base_path: Path,
    expert_paths: Sequence[Path],
) -> AlignedInputs:
    """Align the opened ``base`` and ``experts`` of ``recipe`` (local paths ``base_path``, ``expert_paths``);
    reads names, shapes and dtypes only, never tensor data."""
    keys = list(recipe.expert_keys or [])
    labels = [f"expert '{key}'" for key in keys]
    source = _config_source(recipe, experts, expert_paths, labels)
    config_path = base_path if source < 0 else Path(expert_paths[source])
    target = (base if source < 0 else experts[source]).infos()
    into = "the base" if source < 0 else labels[source]

    # 2. names: each input's map into the output's names
    if source < 0:
        base_map = identity_map(list(base.infos()))
    else:
        base_map = find_name_map(_shapes(base.infos()), _shapes(target), what="the base", into=into)
        _check_strength(base_map, base.infos(), min(len(base.infos()), len(target)), "the base", into)
    maps = []
    for i, expert in enumerate(experts):
        if expert.low_rank:  # an adapter names the base's tensors
            maps.append(base_map)
        elif i == source:
            maps.append(identity_map(list(expert.infos())))
        else:
            found = find_name_map(_shapes(expert.infos()), _shapes(target), what=labels[i], into=into)
            _check_strength(found, expert.infos(), min(len(expert.infos()), len(base.infos())), labels[i], into)
            maps.append(found)

    # what the output holds: the base's tensors in the output's names, and the experts' own tensors
    base_names = list(base_map.names)
    dropped = [name for name in base_names if source >= 0 and name not in target]
    kept_base = [name for name in base_names if name not in dropped]
    base_set = set(base_names)
    own_names = list(  # in expert order, each once
        dict.fromkeys(
            n for e, m in zip(experts, maps, strict=True) if not e.low_rank for n in m.names if n not in base_set
        )
    )
    chosen = _module_sources(recipe, own_names, kept_base, keys, experts, labels)
    own_names = [n for n in own_names if chosen[n][0] != DROP]
    keep = set(kept_base) | set(own_names)

    # views in the output's names, without what the output drops
    base_view = _renamed_source(base, {o: n for o, n in base_map.names.items() if o in keep})
    views = [
        _renamed_expert(e, {o: n for o, n in m.names.items() if o in keep}) for e, m in zip(experts, maps, strict=True)
    ]

    # 3. vocabulary stage (H3): the base and experts are views in the output's names here
    base_view, views, vocabulary = vocabulary_stage(recipe, base_view, views, base_path, expert_paths)

    # 4. own modules
    own_tensors, reasons, groups = _own_tensors(own_names, chosen, views, keys, target, kept_base)
    order = [n for n in target if n in keep] + [n for n in own_names if n not in target]
    if own_tensors:
        compute = getattr(torch, recipe.compute_dtype)
        base_view = OwnModulesSource(base_view, own_tensors, order, compute)
    elif order != list(base_view.infos()):
        base_view = RenamedSource(base_view, {n: n for n in order})

    notes: dict[str, Any] = {}
    if source >= 0:
        notes["config_source"] = keys[source]
    names = {} if base_map.identity else {"base": base_map.summary()}
    names.update({keys[i]: m.summary() for i, m in enumerate(maps) if not m.identity and not experts[i].low_rank})
    if names:
        notes["names"] = names
    if groups:
        notes["modules"] = groups
        say_unloaded(groups, "the base's" if source < 0 else f"expert '{keys[source]}''s")
    gone = _dropped_notes(dropped, chosen, kept_base, into)
    if gone:
        notes["dropped"] = gone
    if vocabulary.notes:
        notes["vocabulary"] = vocabulary.notes
    return AlignedInputs(base_view, views, config_path, reasons, notes, vocabulary)


def _shapes(infos: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(info.shape) for name, info in infos.items()}


def _config_source(recipe: Recipe, experts: Sequence[Expert], paths: Sequence[Path], labels: list[str]) -> int:
    """-1 for the base, else the index of the expert whose config the output gets (checked to have one)."""
    source = input_index(recipe.config_source, recipe.experts, recipe.expert_keys or [])
    if source is None:  # the recipe validated it; a Recipe built without validation can still get here
        raise AlignError(f"config_source '{recipe.config_source}' names no input: use base or an expert's name")
    if source < 0:
        return source
    if experts[source].low_rank:
        raise AlignError(
            f"config_source {labels[source]} is a LoRA adapter: its model's config is the base's; use "
            "config_source: base (or an expert saved as a full model)"
        )
    file = config_file(paths[source])
    if file is None or not file.is_file():
        raise AlignError(
            f"config_source {labels[source]} ({paths[source]}) has no config.json: give that expert as its model "
            "folder, or use config_source: base"
        )
    return source


def _check_strength(found: NameMap, infos: Mapping[str, Any], could: int, what: str, into: str) -> None:
    """Refuse a map that matches fewer than MIN_MATCHED_SHARE of the ``could`` tensors two checkpoints could
    share: they are not the same model under two wrappers."""
    needed = max(1, math.ceil(MIN_MATCHED_SHARE * could))
    if len(found.matched) >= needed:
        return
    tried = f" (best: {found.describe()})" if found.rewrites else ""
    example = next(iter(infos), "?")
    raise AlignError(
        f"only {len(found.matched)} of the {len(infos)} tensors of {what} match the tensor names of {into}"
        f"{tried}, fewer than {needed}: it is another architecture (e.g. '{example}' matches nothing); merge "
        "checkpoints of one base model, or choose another config_source"
    )


def _renamed_source(source: TensorSource, names: dict[str, str]) -> TensorSource:
    same = list(names) == list(source.infos()) and all(o == n for o, n in names.items())
    return source if same else RenamedSource(source, names)


def _renamed_expert(expert: Expert, names: dict[str, str]) -> Expert:
    same = list(names) == list(expert.infos()) and all(o == n for o, n in names.items())
    return expert if same else RenamedExpert(expert, names)


def _module_sources(
    recipe: Recipe,
    own_names: Sequence[str],
    shared: Sequence[str],
    keys: Sequence[str],
    experts: Sequence[Expert],
    labels: Sequence[str],
) -> dict[str, tuple[str | int | None, str | None]]:
    """Each own tensor's source from ``recipe.modules``: (expert index | DROP | None for the holders, pattern)."""
    patterns = list(recipe.modules.items())
    used = [False] * len(patterns)
    chosen: dict[str, tuple[str | int | None, str | None]] = {}
    for name in own_names:
        chosen[name] = (None, None)
        for i, (pattern, source) in enumerate(patterns):
            if fnmatch.fnmatchcase(name, pattern):
                used[i] = True
                index = DROP if source == DROP else input_index(source, recipe.experts, keys)
                chosen[name] = (index, pattern)
                break
    for (pattern, source), matched in zip(patterns, used, strict=True):
        index = None if source == DROP else input_index(source, recipe.experts, keys)
        if isinstance(index, int) and index >= 0 and experts[index].low_rank:
            raise AlignError(
                f"modules '{pattern}': {labels[index]} is a LoRA adapter, which holds deltas of the base's tensors, "
                "no modules of its own; name an expert saved as a full model"
            )
        if not matched:
            _unused_pattern(pattern, own_names, shared)
    return chosen


def _unused_pattern(pattern: str, own_names: Sequence[str], shared: Sequence[str]) -> None:
    in_base = next((n for n in shared if fnmatch.fnmatchcase(n, pattern)), None)
    if in_base is not None:
        raise AlignError(
            f"modules '{pattern}' matches only tensors the base has (e.g. '{in_base}'): modules chooses where "
            "tensors the base lacks come from; shared tensors are merged (use overrides to treat them otherwise)"
        )
    if not own_names:
        raise AlignError(
            f"modules '{pattern}' matches nothing: the experts hold no tensors that the base lacks; remove it"
        )
    example = closest_name(pattern, list(own_names), cutoff=0)
    raise AlignError(
        f"modules '{pattern}' matches no tensor of the experts' own modules (names look like '{example}'): fix the "
        "pattern or remove it"
    )


def say_unloaded(groups: Sequence[Mapping[str, Any]], config: str) -> None:
    """A console line for each kept own module that the output's config has no place for: transformers would
    never load it (report.json's ``in_config: false``)."""
    for group in groups:
        if not group["in_config"]:
            source = group["from"][0]
            LOG.warning(
                f"module '{group['module']}' ({group['tensors']} tensors, {group['how']} from expert "
                f"'{', '.join(group['from'])}') is written, but the output's config ({config}) has no such module, so "
                f"transformers will not load it: to build on that expert's model, --config-source {source}; "
                f"else drop it, --module '{group['module']}.*=drop'"
            )


def _own_tensors(
    own_names: Sequence[str],
    chosen: Mapping[str, tuple[str | int | None, str | None]],
    views: Sequence[Expert],
    keys: Sequence[str],
    target: Mapping[str, Any],
    shared: Sequence[str],
) -> tuple[dict[str, OwnTensor], dict[str, str], list[dict[str, Any]]]:
    """The own tensors (where each is read from), their plan reasons and the report's groups by module."""
    labels = [f"expert '{key}'" for key in keys]
    roots = _module_roots(own_names, shared)
    tensors: dict[str, OwnTensor] = {}
    reasons: dict[str, str] = {}
    groups: dict[tuple, dict[str, Any]] = {}
    for name in own_names:
        holders = [i for i, view in enumerate(views) if name in view.infos()]
        index, pattern = chosen[name]
        if isinstance(index, int):
            holders = _named_holder(name, index, pattern, holders, views, labels, target)
        infos = [views[i].infos()[name] for i in holders]
        if len({tuple(info.shape) for info in infos}) > 1:
            a, b = holders[0], next(i for i in holders if tuple(views[i].infos()[name].shape) != tuple(infos[0].shape))
            raise AlignError(
                f"own module tensor '{name}' has shape {tuple(infos[0].shape)} in {labels[a]} but "
                f"{tuple(views[b].infos()[name].shape)} in {labels[b]}, so it cannot be averaged: name its source, "
                f"e.g. modules: {{'{roots[name]}.*': {keys[a]}}} (--module '{roots[name]}.*={keys[a]}')"
            )
        if not infos[0].dtype.is_floating_point and len(holders) > 1:
            holders = holders[:1]  # an index table is not averaged: the first holder's
            infos = infos[:1]
        dtype = average_dtype([info.dtype for info in infos])
        info = TensorInfo(name, tuple(infos[0].shape), dtype)
        tensors[name] = OwnTensor(info, tuple(views[i] for i in holders), tuple(labels[i] for i in holders))
        who = ", ".join(f"'{keys[i]}'" for i in holders)
        if len(holders) == 1:
            reasons[name] = f"own module of {labels[holders[0]]}" + (f" (modules '{pattern}')" if pattern else "")
        else:
            reasons[name] = f"own module, average of experts {who}"
        key = (roots[name], tuple(holders), pattern, name in target)
        group = groups.setdefault(
            key,
            {
                "module": roots[name],
                "tensors": 0,
                "from": [keys[i] for i in holders],
                "how": "copied" if len(holders) == 1 else "averaged",
                "in_config": name in target,
            },
        )
        if pattern:
            group["named_by"] = f"modules '{pattern}'"
        group["tensors"] += 1
    return tensors, reasons, list(groups.values())


def _named_holder(
    name: str,
    index: int,
    pattern: str | None,
    holders: Sequence[int],
    views: Sequence[Expert],
    labels: Sequence[str],
    target: Mapping[str, Any],
) -> list[int]:
    """[index], checked: that expert holds ``name``, in the shape of the output's config when it has one."""
    if index not in holders:
        held = ", ".join(labels[i] for i in holders)
        raise AlignError(
            f"modules '{pattern}' takes '{name}' from {labels[index]}, which does not hold it (held by {held}): "
            "name one of those, or narrow the pattern"
        )
    shape = tuple(views[index].infos()[name].shape)
    if name in target and tuple(target[name].shape) != shape:
        raise AlignError(
            f"modules '{pattern}' takes '{name}' of shape {shape} from {labels[index]}, but the output's config has "
            f"it as {tuple(target[name].shape)}: take it from an expert of the config's shape, or change config_source"
        )
    return [index]


def _module_roots(names: Sequence[str], shared: Sequence[str]) -> dict[str, str]:
    """Each name's module: its shortest dotted prefix that no shared tensor's name lies under."""
    prefixes = set()
    for other in shared:
        parts = other.split(".")
        prefixes.update(".".join(parts[:k]) for k in range(1, len(parts) + 1))
    roots = {}
    for name in names:
        parts = name.split(".")
        roots[name] = next(
            (".".join(parts[:k]) for k in range(1, len(parts) + 1) if ".".join(parts[:k]) not in prefixes), name
        )
    return roots


def _dropped_notes(
    dropped: Sequence[str], chosen: Mapping[str, tuple[Any, str | None]], shared: Sequence[str], into: str
) -> list[dict[str, Any]]:
    """The report's list of what the output leaves out, grouped by module."""
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    roots = _module_roots(dropped, shared)
    for name in dropped:
        why = f"not in the config of {into}"
        group = groups.setdefault((roots[name], why), {"module": roots[name], "tensors": 0, "from": "base", "why": why})
        group["tensors"] += 1
    dropped_own = [name for name, (index, _) in chosen.items() if index == DROP]
    roots = _module_roots(dropped_own, shared)
    for name in dropped_own:
        why = f"modules '{chosen[name][1]}': drop"
        group = groups.setdefault(
            (roots[name], why), {"module": roots[name], "tensors": 0, "from": "experts", "why": why}
        )
        group["tensors"] += 1
    return list(groups.values())
