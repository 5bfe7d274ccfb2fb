"""Names from other merging tools (mergekit's) that a specmerge recipe does not take, each with what to write instead.

A did-you-mean hint is right for a typo and wrong for another tool's word: mergekit's ``rescale`` is not specmerge's
``scale``, its ``nuslerp`` is not ``slerp``, its ``models`` list is not ``modules``. An unknown name found here gets
its own explanation instead of the closest known name (:func:`specmerge.errors.unknown_name_message`'s ``foreign``).
"""

from __future__ import annotations

GUIDE = "docs/mergekit.md maps mergekit's keys"

# Recipe keys of a mergekit config.
RECIPE_KEYS: dict[str, str] = {
    "models": "'models' is mergekit's list of inputs: a specmerge recipe names the fine-tuned models 'experts' and "
    f"the model they were fine-tuned from 'base' ({GUIDE})",
    "merge_method": f"'merge_method' is mergekit's key: a specmerge recipe says 'method' ({GUIDE})",
    "base_model": f"'base_model' is mergekit's key: a specmerge recipe says 'base' ({GUIDE})",
    "parameters": f"'parameters' is mergekit's key: a specmerge recipe says 'params' ({GUIDE})",
    "out_dtype": f"'out_dtype' is mergekit's key: a specmerge recipe says 'dtype' for the output ('compute_dtype' for "
    f"the arithmetic; {GUIDE})",
    "slices": "'slices' is mergekit's layer ranges: a specmerge recipe stacks layers with 'layers' (method "
    f"passthrough), and `specmerge run` runs a mergekit config as it is ({GUIDE})",
    "tokenizer": "'tokenizer' is mergekit's tokenizer section: a specmerge recipe says 'tokenizer_source' (union, "
    "base or an expert's name)",
}

# Method parameters of mergekit that are not specmerge's, whatever the method.
PARAMS: dict[str, str] = {
    "lambda": "'lambda' is mergekit's name for the factor on the merged task vector: specmerge's is 'scale'",
    "rescale": "'rescale' is a parameter of the sparsifying methods only (ties, the DARE and DELLA methods, "
    "breadcrumbs): this method drops nothing to rescale",
    "int8_mask": "'int8_mask' only changes the dtype of mergekit's sign masks (memory, not the result): specmerge's "
    "masks are boolean already; remove it",
    "weight": "per-expert weights are not a method parameter: give them with the experts "
    "(experts: [{path: ..., weight: 0.6}], expert_weights: [...] or --weight)",
    "normalize": "'normalize' is a parameter of linear and of the sparsifying methods (ties, the DARE and DELLA "
    "methods, breadcrumbs) only",
    "filter_wise": "'filter_wise' is a parameter of specmerge's 'model_stock' only",
}

# mergekit's DARE spells the share kept; specmerge's the share dropped.
DARE_DENSITY = (
    "'density' is mergekit's share of entries kept; specmerge's DARE takes the share dropped: drop_rate = 1 - density"
)
DARE_METHODS = frozenset({"dare_ties", "dare_task_arithmetic", "dare_linear"})

# mergekit's methods that specmerge does not have; none of them is the closest name's method.
METHODS: dict[str, str] = {
    name: f"'{name}' is a mergekit method that specmerge does not implement yet ({what}); it is not the same as any "
    "method specmerge has: `specmerge methods` lists them"
    for name, what in {"task_adapter": "merging task adapters"}.items()
}


def param_hint(method: str, name: str) -> str | None:
    """What to write instead of ``name``, a parameter method ``method`` does not have, when it is mergekit's."""
    if name == "density" and method in DARE_METHODS:
        return DARE_DENSITY
    return PARAMS.get(name)
