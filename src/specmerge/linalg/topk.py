"""Exact top-k selection by magnitude, with ties broken in storage order (the TIES trim, the breadcrumbs band).

A selection is a *rule* ``(threshold, last)`` (:func:`top_k_rule`) rather than a mask, so that a tensor
can be masked chunk by chunk (:func:`keep_mask`) without an N x tensor temporary.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

TopKRule = tuple[float, int]  # (threshold, last): see top_k_rule
KEEP_ALL: TopKRule = (-math.inf, -1)  # the rule that keeps every entry


def fraction_count(fraction: float, numel: int, *, round_up: bool = True) -> int:
    """ceil (or floor) of fraction * numel, with ``fraction`` read as the decimal it was written as, in [0, numel].

    Fraction(repr(.)) is exact: 0.14 * 100 is 14, not ceil(14.000000000000002) = 15.
    """
    exact = Fraction(repr(float(fraction))) * numel
    return max(0, min(numel, math.ceil(exact) if round_up else math.floor(exact)))


def top_k_count(density: float, numel: int) -> int:
    """k = ceil(density * numel) entries kept of ``numel`` at ``density`` (TIES), exactly (:func:`fraction_count`)."""
    return fraction_count(density, numel)


def top_k_rule(values: torch.Tensor, k: int) -> TopKRule:
    """Which entries of a 1-D float tensor are its k largest in magnitude, exactly, in O(numel).

    Returns ``(threshold, last)``: entry j is kept iff ``|v_j| > threshold``, or ``|v_j| == threshold``
    and ``j <= last`` (equal magnitudes at the threshold go in storage order). A radix select on the bit
    patterns, which order like the magnitudes: one histogram of the top 16 bits of |v| finds the bucket
    holding the k-th largest, and a selection among that bucket's entries (about 1/128 of an octave's)
    finishes. 10-20x faster than ``torch.topk`` or ``torch.kthvalue`` on the CPU (BENCHMARKS.md, issue 6).
    The top-k set grows with k: the rule for k contains the rule for any smaller k.
    """
    n = values.numel()
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}], got {k}")
    if values.dtype == torch.float64:
        keys = (values.view(torch.int64) & 0x7FFF_FFFF_FFFF_FFFF).bitwise_right_shift_(48).to(torch.int32)
    else:
        values = values.float()  # exact for 16-bit floats
        keys = (values.view(torch.int32) & 0x7FFF_FFFF).bitwise_right_shift_(16)
    histogram = torch.bincount(keys, minlength=1 << 16)
    from_top = histogram.flip(0).cumsum(0)  # entries in the top j + 1 buckets
    j = int(torch.searchsorted(from_top, k))
    bucket = histogram.numel() - 1 - j
    above = int(from_top[j] - histogram[bucket])  # entries in higher buckets, all larger
    positions = torch.nonzero(keys == bucket).squeeze(1)  # ascending
    candidates = values[positions].abs()
    threshold = torch.kthvalue(candidates, candidates.numel() - (k - above) + 1).values
    missing = k - above - int(torch.count_nonzero(candidates > threshold))
    ties = positions[candidates == threshold]
    return float(threshold), int(ties[missing - 1]) if missing else -1


def keep_mask(values: torch.Tensor, rule: TopKRule, start: int = 0) -> torch.Tensor:
    """The keep-mask of ``values`` = entries ``start, start + 1, ...`` of the tensor ``rule`` was made for."""
    threshold, last = rule
    magnitudes = values.abs()
    keep = magnitudes > threshold
    if last >= start:
        head = slice(0, last + 1 - start)
        keep[head] |= magnitudes[head] == threshold
    return keep
