"""Fused expert stacks of mixture-of-experts models: 3-D weights ``[E, ., .]`` that are E linear layers.

gpt-oss and Llama 4 checkpoints store each MoE block's experts as one tensor per projection,
``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj`` (Llama 4: ``feed_forward.experts.*``), of shape
``[E, in, out]``: slice e is expert e's weight, stored transposed against ``nn.Linear``'s ``[out, in]``
(the modeling code computes ``x @ gate_up_proj[e]``). transformers 5 fuses the per-expert 2-D weights of Mixtral,
Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3 and GraniteMoE into the same names in memory, as ``[E, out, in]``
(``F.linear(x, gate_up_proj[e])``), and saves them per expert again; a state dict of such a model (the in-memory
API) or a checkpoint saved fused carries the stacks. Both orientations were read off the models of transformers
5.24 (tiny instances' state dicts, and what ``save_pretrained`` wrote).

:func:`expert_stacks` names the stacks of a checkpoint from its config's ``model_type`` (and a sub-config's, as
``text_config`` of Llama 4), with the orientation of their slices; a 3-D floating tensor under ``.experts.`` of a
model type not in :data:`STACK_LAYOUTS` is a stack of unknown orientation (None), which matrix methods refuse
(:mod:`specmerge.pipeline.plan.rules`). Each stack is merged slice by slice, as E linear layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

IN_OUT, OUT_IN = True, False  # slices stored (in, out) (transposed against nn.Linear), or (out, in)
STACK_LAYOUTS: dict[str, bool] = {
    "gpt_oss": IN_OUT,
    "llama4": IN_OUT,
    "llama4_text": IN_OUT,
    "mixtral": OUT_IN,
    "qwen2_moe": OUT_IN,
    "qwen3_moe": OUT_IN,
    "olmoe": OUT_IN,
    "deepseek_v2": OUT_IN,
    "deepseek_v3": OUT_IN,
    "granitemoe": OUT_IN,
}
STACK_ENDINGS = (".experts.gate_up_proj", ".experts.down_proj", ".experts.gate_proj", ".experts.up_proj")


def model_types(config: Mapping[str, Any] | None) -> list[str]:
    """The ``model_type`` of ``config`` and of its sub-configs (``text_config``, ...), outermost first."""
    if not isinstance(config, Mapping):
        return []
    found = [config["model_type"]] if isinstance(config.get("model_type"), str) else []
    for value in config.values():
        if isinstance(value, Mapping):
            found += model_types(value)
    return found


def is_stack_name(name: str) -> bool:
    """Whether ``name`` is where MoE models keep a stack of their experts' weights."""
    return name.endswith(STACK_ENDINGS) or ".experts." in name


def expert_stacks(config: Mapping[str, Any] | None, infos: Mapping[str, Any]) -> dict[str, bool | None]:
    """The 3-D floating tensors of ``infos`` (name -> object with ``.shape`` and ``.dtype``) that are stacks of
    experts' linear weights, mapped to whether their slices are stored (in, out) (True), (out, in) (False), or
    in an orientation that the config's model type does not tell (None)."""
    known = [STACK_LAYOUTS[t] for t in model_types(config) if t in STACK_LAYOUTS]
    layout = known[0] if known else None
    return {
        name: layout
        for name, info in infos.items()
        if len(info.shape) == 3 and info.dtype.is_floating_point and is_stack_name(name)
    }
