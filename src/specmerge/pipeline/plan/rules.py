"""The merge plan: what happens to each tensor, decided from names, shapes and dtypes before any data is read.

Every tensor of the base gets one action: ``merge`` (run a method on the N task vectors), ``average``
(W_0 + s * mean of the task vectors) or ``keep_base`` (copy W_0). The rules, in order, follow the
paper (merge the 2-D linear weights, average the rest):

0. The method ``passthrough`` (a copy of the base, or a frankenmerge's stacked layers): ``keep_base``, every tensor.

1. Not floating point (integer buffers such as ``position_ids``, boolean masks): ``keep_base``.
   Overrides cannot change this: there is nothing to average in an index table.
2. Overrides, in recipe order; the first whose fnmatch ``pattern`` matches the name wins.
   ``keep_base`` and ``average`` as given; ``merge`` uses the override's method and params, or the
   recipe's. A method that needs 2-D weights on a tensor that is not 2-D is an error.
2b. Stacks of experts' weights (3-D ``[E, ., .]`` of MoE blocks, :mod:`specmerge.io.formats.stacks`): ``merge``
   with the method, slice by slice as E linear layers (``stacked``; ``transposed`` when slices are (in, out)); a
   matrix method refuses a stack whose layout the model's config does not tell, instead of averaging it.
3. Embeddings and output heads (:func:`is_embedding`: ``embed_tokens``, ``wte``, ``lm_head``, ``shared``,
   CLIP ``patch_embedding``, ...): with ``recipe.merge_embeddings`` they follow rules 4-5 like any other tensor;
   without it, ``recipe.non_matrix``. Unset (auto), the method's convention decides (:func:`embeddings_merged`):
   methods defined on linear layers (``needs_matrix``: the spectral family, WUDI, TSV-M, ...) average them, as
   their papers do; every other method merges them, as mergekit does. The console's account of every tensor
   that does not get the recipe's method, and why: :func:`specmerge.pipeline.plan.summary.not_merged_line`.
4. 2-D floating tensors whose last name component contains ``weight`` (``q_proj.weight``, CLIP's
   ``in_proj_weight``, GPT-2's Conv1D ``c_attn.weight``): ``merge`` with the recipe's method. A fused
   weight (qkv, gate_up) is one 2-D layer. Conv1D weights are stored (in, out): the plan marks them
   ``transposed`` (from the base's config.json, :mod:`specmerge.io.formats.layout`) and matrix methods see them
   as (out, in).
5. Everything else that is floating (1-D norms and biases, >= 3-D conv kernels, 2-D parameters not
   named ``weight``): ``merge`` when the method is elementwise (task arithmetic, TIES and DARE apply to
   every tensor, as in their papers); ``recipe.non_matrix`` when the method needs matrices.

Averaged entries carry ``params = {"scale": s}``: s is the recipe method's ``scale`` when
``recipe.scale_non_matrix`` is set, else 1 (a plain average). ``keep_base`` entries carry no params.

Output dtype: the base tensor's dtype when ``recipe.dtype`` is ``auto``, else the recipe's dtype for
floating tensors; non-floating tensors keep theirs.

Own modules of experts (tensors some experts hold and the base lacks: a vision tower, a task head), which the
aligned base serves (:mod:`specmerge.pipeline.inputs.align`), are ``keep_base`` with their reason (``own module of
expert 'a'``), before any override: they have no base to merge with, and the experts that lack them are never
read for them.

Every base tensor that is merged or averaged must exist in every expert with the same shape (dtypes
may differ: bf16 and fp32 experts mix fine); ``keep_base`` tensors are not read from the experts, so a
resized vocabulary can be kept from the base with an override. A tensor that an expert has and the base
lacks is an error, since it would be dropped. An override that matches no tensor is an error too (a
misspelled pattern would otherwise change nothing, silently).

The plan keeps the base's tensor order. Tied weights: Hugging Face stores a tied pair once; when a
checkpoint does hold both names (``embed_tokens`` and ``lm_head``) they are separate entries that get the
same rule, so deterministic methods give them identical results (DARE's masks depend on the tensor
name, so tied copies differ; ``transformers`` re-ties them on load).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from specmerge.errors import SpecmergeError, closest_name
from specmerge.methods import Method, get_method
from specmerge.pipeline.plan.values import resolve
from specmerge.pipeline.recipe.layered import layer_positions
from specmerge.pipeline.recipe.model import DTYPES, Recipe

Action = Literal["merge", "average", "keep_base"]

# Name components of token/position/patch embeddings and output heads, across model families.
EMBEDDING_COMPONENTS = frozenset(
    {
        "embed_tokens", "embed_positions", "embed_in", "embed_out", "tok_embeddings",  # Llama, OPT, GPT-NeoX, Meta
        "wte", "wpe",  # GPT-2
        "word_embeddings", "position_embeddings", "token_type_embeddings",  # BERT, RoBERTa, BLOOM, Falcon
        "shared", "relative_attention_bias",  # T5
        "lm_head", "output_layer",  # output heads (ChatGLM calls it output_layer)
        "token_embedding", "position_embedding", "patch_embedding", "class_embedding",  # CLIP (HF)
        "positional_embedding",  # open_clip
        "patch_embed", "pos_embed", "cls_token", "dist_token",  # timm ViT, Qwen-VL vision towers
    }
)  # fmt: skip
# Whole-name endings that are embeddings or heads tied to one.
EMBEDDING_SUFFIXES = (".embeddings.weight", ".embedding.weight", "predictions.decoder.weight")  # Mamba, BERT MLM
EMBEDDING_NAMES = frozenset({"output.weight", "embeddings.weight", "embedding.weight"})  # Meta's original lm_head


class TensorInfoLike(Protocol):
    """What the plan needs to know of a stored tensor (``specmerge.io.formats.protocol.TensorInfo`` is one)."""

    name: str
    shape: Sequence[int]
    dtype: torch.dtype


@dataclass(frozen=True)
class TensorPlan:
    """The decision for one tensor."""

    name: str
    shape: tuple[int, ...]
    out_dtype: torch.dtype
    action: Action
    method: str | None  # for merge
    params: dict[str, Any]  # merge: the method's complete params; average: {"scale": s}; keep_base: {}
    reason: str  # short human text: "2-D linear weight", "embedding", "override '*.mlp.*'", ...
    transposed: bool = (
        False  # stored (in, out), a Conv1D weight (specmerge.io.formats.layout): matrix methods see its transpose
    )
    stacked: bool = False  # [E, ., .]: E experts' linear weights (specmerge.io.formats.stacks), merged one by one
    weights: tuple[float, ...] | None = None  # this tensor's expert weights (merge, average); None: none given


class PlanError(SpecmergeError):
    """The checkpoints and the recipe do not fit together; the message names the tensor and the file."""


def is_embedding(name: str) -> bool:
    """Whether ``name`` is a token/position/patch embedding or an output head (``lm_head``) by its name."""
    if name in EMBEDDING_NAMES or name.endswith(EMBEDDING_SUFFIXES):
        return True
    return any(part in EMBEDDING_COMPONENTS for part in name.split("."))


def default_action(
    name: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    method: Method,
    recipe: Recipe,
    stack: bool | Literal["no"] | None = "no",
) -> tuple[Action, str]:
    """The action and reason for a tensor no override matches (rules 1 and 3-5 of the module docstring).
    ``stack``: "no", or the orientation of an expert stack's slices (True: (in, out); None: unknown)."""
    if not dtype.is_floating_point:
        return "keep_base", "not floating point"
    if stack != "no":
        check_stack(name, shape, method, stack)
        return "merge", STACK_REASON
    kind = _kind(name, len(shape))
    if is_embedding(name):
        if not embeddings_merged(recipe, method):
            return recipe.non_matrix, EMBEDDING_REASONS[recipe.merge_embeddings is None]
        kind = "embedding" if len(shape) == 2 else f"embedding, {kind}"
        return ("merge", kind) if len(shape) == 2 or not method.needs_matrix else (recipe.non_matrix, kind)
    if kind == "2-D linear weight" or not method.needs_matrix:
        return "merge", kind
    return recipe.non_matrix, kind


STACK_REASON = "expert stack (E linear layers)"
EMBEDDING_REASONS = {  # by whether merge_embeddings was left unset (auto)
    True: "embedding; a method of linear layers",
    False: "embedding; merge_embeddings: false",
}


def embeddings_merged(recipe: Recipe, method: Method) -> bool:
    """Whether embeddings get ``method``: ``recipe.merge_embeddings``, or when unset the method's convention (not
    for methods of linear layers)."""
    if recipe.merge_embeddings is not None:
        return recipe.merge_embeddings
    return not method.needs_matrix


def check_stack(name: str, shape: Sequence[int], method: Method, stack: bool | None) -> None:
    """Refuse a matrix method on an expert stack whose slices' orientation the model's config does not tell."""
    if stack is None and method.needs_matrix:
        raise PlanError(
            f"tensor '{name}' of shape {tuple(shape)} is a stack of {shape[0]} experts' weights, and the config's "
            "model type is not one whose stacks specmerge knows the layout of (specmerge.io.formats.stacks), so "
            f"'{method.name}', which needs each expert's weight as (out, in), cannot merge it: use an elementwise "
            f"method, or average it with an override {{pattern: '{name}', action: average}}"
        )


def make_plan(
    recipe: Recipe,
    base: Mapping[str, TensorInfoLike],
    experts: Sequence[Mapping[str, TensorInfoLike]],
    expert_paths: Sequence[str],
    transposed: Collection[str] = (),
    own: Mapping[str, str] | None = None,
    stacks: Mapping[str, bool | None] | None = None,
) -> list[TensorPlan]:
    """One :class:`TensorPlan` per base tensor, in the base's order; checks the experts fit the base.

    ``transposed`` names the 2-D weights stored (in, out) (:func:`specmerge.io.formats.layout.transposed_weights`).
    ``own`` maps the tensors of the experts' own modules that ``base`` serves (:mod:`specmerge.pipeline.inputs.align`)
    to their reason: they are kept as read, whatever the overrides say, and no expert is checked for them.
    ``stacks`` maps the 3-D stacks of experts' weights (:func:`specmerge.io.formats.stacks.expert_stacks`) to their
    slices' orientation: a merge treats each as E linear layers (``TensorPlan.stacked``).
    """
    own, stacks = own or {}, stacks or {}
    if len(experts) != len(expert_paths):
        raise PlanError(f"make_plan got {len(experts)} experts but {len(expert_paths)} expert paths")
    method = get_method(recipe.method)
    average_params = {"scale": recipe.params.get("scale", 1.0) if recipe.scale_non_matrix else 1.0}
    positions = layer_positions(base)
    used = [False] * len(recipe.overrides)
    plan = []
    problems: list[str] = []
    for name, info in base.items():
        shape = tuple(int(d) for d in info.shape)
        copied = "passthrough" if method.name == "passthrough" else own.get(name)  # no expert is read for these
        if copied is not None:
            out_dtype = DTYPES[recipe.dtype] if recipe.dtype != "auto" and info.dtype.is_floating_point else info.dtype
            plan.append(TensorPlan(name, shape, out_dtype, "keep_base", None, {}, copied))
            continue
        stack = stacks.get(name, "no")
        entry, weights = _plan_tensor(name, shape, info.dtype, method, recipe, average_params, used, stack)
        if stack != "no" and entry.action == "merge":
            entry = dataclasses.replace(entry, stacked=True, transposed=bool(stack))
        try:  # the values of this tensor: gradients, conditions, per-expert values, weights
            entry = resolve(entry, positions[name], weights, recipe.expert_params, len(experts))
        except ValueError as err:
            at = "" if positions[name] is None else f" (layer position {positions[name]:g})"
            raise PlanError(f"tensor '{name}'{at}{' ' if str(err).startswith('is ') else ': '}{err}") from None
        if name in transposed:
            entry = dataclasses.replace(entry, transposed=True)
        plan.append(entry)
        if entry.action != "keep_base":
            problems += _expert_problems(name, shape, experts, expert_paths, dtype=info.dtype)
    for expert, path in zip(experts, expert_paths, strict=True):
        problems += [
            f"tensor '{name}' is in expert '{path}' but not in the base: it would be dropped from the merged model; "
            "merge only experts fine-tuned from this base"
            for name in expert
            if name not in base
        ]
    if problems:
        more = f" (and {len(problems) - 1} more such problems)" if len(problems) > 1 else ""
        raise PlanError(problems[0] + more)
    shared = {name: info for name, info in base.items() if name not in own}
    for i, matched in enumerate(used):
        if not matched:
            _unused_override(i, recipe.overrides, shared, own)
    return plan


def _unused_override(
    index: int, overrides: Sequence[Any], base: Mapping[str, TensorInfoLike], own: Collection[str] = ()
) -> None:
    """Raise for an override that no tensor gets: it matches none, or only own modules of experts (never merged),
    earlier overrides take all it matches, or it matches only tensors that are not floating point (always kept)
    and asks for something else."""
    override = overrides[index]
    names = [name for name in base if fnmatch.fnmatchcase(name, override.pattern)]
    own_match = next((name for name in own if fnmatch.fnmatchcase(name, override.pattern)), None)
    if not names and own_match is not None:
        raise PlanError(
            f"override '{override.pattern}' matches only own modules of experts (e.g. '{own_match}'), which are "
            "taken from the experts that hold them, not merged: choose their source with modules: "
            "{pattern: expert} (or drop), and remove the override"
        )
    if not names:
        example = closest_name(override.pattern, list(base), cutoff=0)
        hint = f" (names look like '{example}')" if example else ""
        raise PlanError(
            f"override '{override.pattern}' matches no tensor of the base{hint}: fix the pattern or remove it"
        )
    floating = [name for name in names if base[name].dtype.is_floating_point]
    if not floating:
        if override.action == "keep_base":
            return  # what it asks for happens anyway
        raise PlanError(
            f"override '{override.pattern}' matches only tensors that are not floating point (e.g. '{names[0]}'), "
            "which are always kept from the base: remove it or fix the pattern"
        )
    earlier = next(o for o in overrides[:index] if fnmatch.fnmatchcase(floating[0], o.pattern))
    raise PlanError(
        f"override '{override.pattern}' is never applied: every tensor it matches (e.g. '{floating[0]}') is "
        f"matched first by the earlier override '{earlier.pattern}' (the first matching pattern wins): "
        f"remove it, or move it before '{earlier.pattern}'"
    )


def dtype_kind(dtype: torch.dtype) -> str:
    """``bool``, ``integer``, ``floating point`` or ``complex``: experts may change a tensor's precision, not this."""
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "floating point" if dtype.is_floating_point else "integer"


def _plan_tensor(
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    method: Method,
    recipe: Recipe,
    average_params: dict[str, float],
    used: list[bool],
    stack: bool | Literal["no"] | None = "no",
) -> tuple[TensorPlan, list[Any] | None]:
    """The tensor's plan (params as given: gradients, conditions) and the expert weights it gets (unresolved)."""
    out_dtype = DTYPES[recipe.dtype] if recipe.dtype != "auto" and dtype.is_floating_point else dtype
    if not dtype.is_floating_point:
        return TensorPlan(name, shape, out_dtype, "keep_base", None, {}, "not floating point"), None
    for i, override in enumerate(recipe.overrides):
        if not fnmatch.fnmatchcase(name, override.pattern):
            continue
        used[i] = True
        reason = f"override '{override.pattern}'"
        weights = recipe.expert_weights if override.expert_weights is None else override.expert_weights
        if override.action != "merge":
            params = dict(average_params) if override.action == "average" else {}
            return TensorPlan(name, shape, out_dtype, override.action, None, params, reason), weights
        chosen = get_method(override.method or recipe.method)
        if stack != "no":
            check_stack(name, shape, chosen, stack)
        elif chosen.needs_matrix and len(shape) != 2:
            raise PlanError(
                f"override '{override.pattern}' merges tensor '{name}' of shape {shape} with '{chosen.name}', "
                "which needs 2-D weights: narrow the pattern (e.g. to '*.weight'), or use action average "
                "or an elementwise method"
            )
        return TensorPlan(name, shape, out_dtype, "merge", chosen.name, dict(override.params), reason), weights
    action, reason = default_action(name, shape, dtype, method, recipe, stack)
    weights = recipe.expert_weights
    if action == "merge":
        return TensorPlan(name, shape, out_dtype, "merge", method.name, dict(recipe.params), reason), weights
    params = dict(average_params) if action == "average" else {}
    return TensorPlan(name, shape, out_dtype, action, None, params, reason), weights


def _expert_problems(
    name: str,
    shape: tuple[int, ...],
    experts: Sequence[Mapping[str, TensorInfoLike]],
    paths: Sequence[str],
    *,
    dtype: torch.dtype,
) -> list[str]:
    problems = []
    for expert, path in zip(experts, paths, strict=True):
        info = expert.get(name)
        if info is None:
            problems.append(
                f"tensor '{name}' is in the base but not in expert '{path}': every expert needs every merged "
                "tensor (an override with action keep_base takes it from the base)"
            )
        elif tuple(int(d) for d in info.shape) != shape:
            problems.append(
                f"tensor '{name}' has shape {tuple(info.shape)} in expert '{path}' but {shape} in the base: "
                "experts must be fine-tuned from this base (an override with action keep_base takes the tensor "
                "from the base)"
            )
        elif dtype_kind(info.dtype) != dtype_kind(dtype):
            problems.append(
                f"tensor '{name}' is {info.dtype} ({dtype_kind(info.dtype)}) in expert '{path}' but {dtype} "
                f"({dtype_kind(dtype)}) in the base: experts may differ from the base in precision (float16, "
                "bfloat16, float32), not in the kind of number; was the expert converted or quantized?"
            )
    return problems


def _kind(name: str, ndim: int) -> str:
    if ndim == 2:
        return "2-D linear weight" if "weight" in name.rsplit(".", 1)[-1] else "2-D, not named weight"
    if ndim == 1:
        return "norm/bias (1-D)"
    if ndim == 0:
        return "scalar"
    return f"{ndim}-D tensor"
