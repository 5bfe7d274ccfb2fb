"""The random draws of DARE's and DELLA's masks: a function of (seed, tensor name, expert key) only.

Each expert's draws come from a generator of its own, seeded from the seed, the tensor's name and the expert's key
(by default a digest of its task vector's content, :func:`content_key`): the same on every device, in every order,
and the global random state untouched.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

CONTENT_SAMPLE = 65536  # entries of a task vector (evenly strided) that identify it for its random mask


def content_key(task_vector: torch.Tensor) -> str:
    """What names an expert's task vector of one tensor for its random mask when no key is given: a digest of up
    to :data:`CONTENT_SAMPLE` of its entries (evenly strided, as float32), so that the mask is a function of the
    expert's weights, never of its folder name or its place in the list."""
    flat = task_vector.reshape(-1)
    step = max(1, flat.numel() // CONTENT_SAMPLE)
    sample = flat[::step][:CONTENT_SAMPLE].to(device="cpu", dtype=torch.float32).contiguous()
    return hashlib.blake2b(sample.numpy().tobytes(), digest_size=8).hexdigest()


def dare_seed(seed: int, tensor_name: str, expert_key: str) -> int:
    """A 64-bit generator seed that depends on (seed, tensor name, expert key) only."""
    digest = hashlib.blake2b(f"{seed}\0{tensor_name}\0{expert_key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def dare_mask(
    shape: Sequence[int] | torch.Size,
    drop_rate: float,
    seed: int,
    tensor_name: str,
    expert_key: str,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Boolean keep-mask, each entry kept with probability 1 - drop_rate (in [0, 1)).

    The mask is a function of (shape, drop_rate, seed, tensor_name, expert_key) only: it is drawn on
    the CPU from its own generator, so it is the same on every device, in every processing order,
    and it leaves the global random state untouched.
    """
    keep = uniform_draws(shape, seed, tensor_name, expert_key) >= drop_rate
    return keep if device is None else keep.to(device)


def uniform_draws(shape: Sequence[int] | torch.Size, seed: int, tensor_name: str, expert_key: str) -> torch.Tensor:
    """float32 uniforms in [0, 1) on the CPU from a generator of their own, seeded by :func:`dare_seed`: the same
    draws on every device and in every order, and the global random state untouched (DARE's and DELLA's masks)."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(dare_seed(seed, tensor_name, expert_key))
    return torch.rand(tuple(shape), generator=generator, dtype=torch.float32)


def mask_keys(task_vectors: torch.Tensor, expert_keys: Sequence[str] | None, tensor_name: str) -> list[str]:
    """The key of each expert's random mask, in stack order: ``expert_keys``, or by default each task vector's own
    :func:`content_key`; one per expert."""
    n = task_vectors.shape[0]
    keys = [content_key(task_vectors[i]) for i in range(n)] if expert_keys is None else list(expert_keys)
    if len(keys) != n:
        raise ValueError(
            f"tensor '{tensor_name or '?'}': got {len(keys)} expert keys for a stack of {n} experts; "
            "pass one key per expert, in stack order"
        )
    return keys
