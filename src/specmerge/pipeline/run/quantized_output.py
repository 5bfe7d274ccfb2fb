"""Which weights of a merged model ``--quantize`` writes in FP8, in which layout, with which quantization_config.

``fp8-block``: every 2-D linear weight (``*.weight``, not an embedding or output head, which stay dense and are
named in ``modules_to_not_convert``), as transformers' ``fp8`` with 128 x 128 blocks. ``same``: the weights the
base stored quantized, in the base's scheme and with its ``quantization_config`` (the base must be transformers'
``fp8`` or ``fbgemm_fp8``). Refused in one line before any work: Conv1D weights (stored (in, out): transformers
quantizes ``nn.Linear`` only), MoE expert stacks, the Ray executor (its workers write the shards themselves), and
``same`` over a base that is not FP8.
"""

from __future__ import annotations

from typing import Any

from specmerge.errors import RecipeError
from specmerge.io.quant.fp8 import FbgemmFP8, FineGrainedFP8
from specmerge.io.quant.output import BLOCK, FP8_BLOCK_CONFIG, OutputQuantizer
from specmerge.io.quant.source import QuantizedSource
from specmerge.pipeline.plan.rules import is_embedding


def output_quantizer(prepared: Any) -> OutputQuantizer | None:
    """The quantizer of a prepared merge's output (:class:`~specmerge.pipeline.plan.prepare.PreparedMerge`), or
    None when the recipe writes it dense."""
    recipe, plan = prepared.recipe, prepared.plan
    if recipe.quantize == "none":
        return None
    if recipe.executor == "ray":
        raise RecipeError("quantize is written by the local executor only (not yet with executor ray)")
    for entry in plan:
        if entry.stacked or (entry.transposed and len(entry.shape) == 2):
            what = "an MoE expert stack" if entry.stacked else "a Conv1D weight stored (in, out)"
            raise RecipeError(
                f"quantize {recipe.quantize}: tensor '{entry.name}' is {what}, which specmerge does not write "
                "quantized yet: write the model dense (quantize: none)"
            )
    linear = [
        e.name for e in plan if len(e.shape) == 2 and e.out_dtype.is_floating_point and e.name.endswith(".weight")
    ]
    if recipe.quantize == "fp8-block":
        targets = [name for name in linear if not is_embedding(name)]
        kept = sorted(name.removesuffix(".weight") for name in linear if is_embedding(name))
        return OutputQuantizer(targets, ("block", BLOCK), {**FP8_BLOCK_CONFIG, "modules_to_not_convert": kept})
    base = prepared.base_quantized
    scheme = base.scheme if isinstance(base, QuantizedSource) else None
    if isinstance(scheme, FineGrainedFP8):
        layout = ("block", scheme.block) if scheme.block else ("tensor", None)
    elif isinstance(scheme, FbgemmFP8):
        layout = ("channel", None)
    else:
        stated = scheme.label if scheme is not None else "not quantized"
        raise RecipeError(
            f"quantize same writes the base's FP8 scheme (transformers' fp8 or fbgemm_fp8), but the base is "
            f"{stated}: use quantize fp8-block, or none"
        )
    targets = [name for name in linear if name in base.packed and len(base.packed[name].shape) == 2]
    return OutputQuantizer(targets, layout, base.quantization_config)
