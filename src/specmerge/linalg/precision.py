"""The compute dtype of a merge: what every method and the factored route cast their inputs to."""

from __future__ import annotations

import torch


def compute_dtype(task_vectors: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Cast to the compute dtype: ``dtype`` if given, float32 for half inputs, else unchanged."""
    if not task_vectors.is_floating_point():
        raise TypeError(f"task vectors must be floating point, got {task_vectors.dtype}")
    if dtype is not None:
        return task_vectors.to(dtype)
    if task_vectors.dtype in (torch.float16, torch.bfloat16):
        return task_vectors.float()
    return task_vectors
