"""Whether each expert looks fine-tuned from the base: the relative distance of a few of its weights from the base's.

Fine-tuning moves a model's linear weights little: the relative Frobenius distance ||W_i - W_0|| / ||W_0|| of a
full fine-tune's layers is typically a few percent (0.1 is already a long continued pre-training), while two
unrelated initialisations of the same architecture are about sqrt(2) = 1.4 apart. :func:`check_related` measures
it on :data:`SAMPLED` linear weights spread over the model (the first, the middle and the last merged 2-D weight),
before the merge starts, and warns with the figures when an expert's median is above :data:`FAR`: merging an
expert that is another model gives a model that is neither, with exit 0. Adapters are not measured (their task
vector is their delta, not a copy of the model).
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from typing import Any

import torch

from specmerge.io.formats.protocol import TensorSource
from specmerge.io.views.experts import Expert
from specmerge.pipeline.plan.rules import TensorPlan

LOG = logging.getLogger("specmerge.inputs")
SAMPLED = 3
FAR = 0.5


def sampled_weights(plan: Sequence[TensorPlan]) -> list[str]:
    """The first, middle and last 2-D linear weights that the plan merges."""
    names = [e.name for e in plan if e.action == "merge" and len(e.shape) == 2 and e.reason == "2-D linear weight"]
    if not names:
        return []
    picks = [names[0], names[len(names) // 2], names[-1]][:SAMPLED]
    return list(dict.fromkeys(picks))


def check_related(
    plan: Sequence[TensorPlan],
    base: TensorSource,
    experts: Sequence[Expert],
    specs: Sequence[str],
    keys: Sequence[str],
) -> list[dict[str, Any]]:
    """report.json's ``relatedness``: each full expert's relative distance from the base on the sampled weights,
    by expert key (``keys``: report.json names no local path); a console warning, naming the expert as given
    (``specs``), for one whose median distance is above :data:`FAR`."""
    names = sampled_weights(plan)
    bases: dict[str, torch.Tensor] = {}
    notes = []
    for expert, spec, key in zip(experts, specs, keys, strict=True):
        if expert.low_rank:
            continue
        distances = {}
        for name in names:
            value = expert.read(name)
            if value.kind != "dense":
                continue
            if name not in bases:
                bases[name] = base.load(name).to(torch.float32)
            w0 = bases[name]
            scale = float(w0.norm())
            if scale > 0:
                distances[name] = float((value.weight.to(torch.float32) - w0).norm()) / scale
        if not distances:
            continue
        median = statistics.median(distances.values())
        notes.append({"expert": key, "relative_distance": distances, "median": median})
        if median > FAR:
            shown = ", ".join(f"{d:.2f} ({name})" for name, d in distances.items())
            LOG.warning(
                f"expert '{spec}' does not look fine-tuned from this base: its weights are {shown} away from the "
                f"base's (relative Frobenius distance; fine-tuning moves them by a few percent, unrelated models "
                f"are about 1.4 apart): is it another model? the merge goes on"
            )
    return notes
