"""Same-shape spectral layers computed together, their decompositions in one batched eigh (issue 50, item 2).

:func:`merge_spectral_batch` is :func:`~specmerge.pipeline.run.compute.merge_tensor` of several entries of one spectral
method, parameters and shape: each entry's stack as the dense route forms it
(:func:`~specmerge.pipeline.run.compute.spectral_stack`), its layer's spectrum made by
:func:`~specmerge.linalg.spectrum.decompose_batch` for all of them at once, then each layer's filter step. The same
bits as one call per entry (on the CPU, torch's batched eigh runs LAPACK once per matrix; tests/test_batching.py).
The streaming executor calls it for a unit of same-key items
(:meth:`~specmerge.pipeline.run.jobs.ModelJob.compute_batch`); a device plan sizes the units
(:mod:`specmerge.pipeline.plan.device`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from specmerge.io.views.task_vectors import TaskVector
from specmerge.linalg.solve import FreshLayer
from specmerge.linalg.spectrum import decompose_batch
from specmerge.methods import get_method
from specmerge.methods.spectral import kept_directions
from specmerge.pipeline.plan.rules import TensorPlan
from specmerge.pipeline.run.compute import route, solved_from_layer, spectral_batchable, spectral_stack
from specmerge.pipeline.run.finite import check_inputs


def batches_spectrally(entry: TensorPlan, values: Sequence[TaskVector], device: torch.device) -> bool:
    """Whether ``entry`` can join a batch of :func:`merge_spectral_batch`: one the plan allows
    (:func:`~specmerge.pipeline.run.compute.spectral_batchable`) whose values take the ``dense`` route."""
    kinds = [value.kind for value in values]
    return spectral_batchable(entry) and route(entry, kinds, device, chunked=False) == "dense"


def merge_spectral_batch(
    entries: Sequence[TensorPlan],
    base_tensors: Sequence[torch.Tensor],
    values: Sequence[Sequence[TaskVector]],
    *,
    device: torch.device,
    compute_dtype: torch.dtype,
) -> list[tuple[torch.Tensor, dict[str, Any]]]:
    """:func:`merge_tensor` of several entries of one spectral method, parameters and shape
    (:func:`batches_spectrally`), their symmetric eigendecompositions made by one batched ``eigh``
    (:func:`~specmerge.linalg.spectrum.decompose_batch`): the same bits as one call per entry. Where the layers'
    decompositions take another route (the SVD of M, the partial eigensolver), or an expert is zero everywhere in
    one of them, each is decomposed alone, as :func:`merge_tensor` does. Holds every entry's stack, C and
    eigenvectors at once: the caller sizes the batch (:mod:`specmerge.pipeline.plan.device`)."""
    method = get_method(entries[0].method)
    layers, settings = [], []
    for entry, base, vals in zip(entries, base_tensors, values, strict=True):
        check_inputs(entry, base.to(device=device, dtype=compute_dtype), ())  # as merge_tensor, in its order
        layers.append(FreshLayer(spectral_stack(entry, base, vals, device=device, compute_dtype=compute_dtype)))
        settings.append(method.validate(entry.params, layers[-1].n_total))
    kinds = [
        "partial" if layer.wants_partial(kept_directions(method.name, params)) else "full"
        for layer, params in zip(layers, settings, strict=True)
    ]
    decomposed = [k for k, layer in enumerate(layers) if layer.n_experts]  # a zero merge needs no spectrum
    spectra = decompose_batch(
        [layers[k].equation for k in decomposed], partial=[kinds[k] == "partial" for k in decomposed]
    )
    for k, spectrum in zip(decomposed, spectra or (), strict=False):
        layers[k].give(kinds[k], spectrum)
    batched = spectra is not None and len(decomposed) > 1
    del spectra  # each layer holds its own
    merged = []
    for k, (entry, base, params) in enumerate(zip(entries, base_tensors, settings, strict=True)):
        layer, layers[k] = layers[k], None  # freed once solved: its stack, C, spectrum and right-hand sides
        base_c = base.to(device=device, dtype=compute_dtype)
        tensor, diagnostics = solved_from_layer(entry, base_c, layer, params, "dense")
        if batched and layer.n_experts:
            diagnostics["batch"] = len(decomposed)
        merged.append((tensor, diagnostics))
        del layer, base_c
    return merged
