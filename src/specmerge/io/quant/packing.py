"""Integer codes packed into int32 words, as quantized checkpoints store them, and the scales laid over them.

Pure tensor functions, no files: :func:`unpack_int32` (element i of a run at bit i*bits, little-endian bit order
across consecutive words: GPTQ, compressed-tensors), :func:`awq_columns` (AutoAWQ's interleaved nibble order) and
:func:`expand_groups` / :func:`expand_blocks` (a scale per group of columns or per 2-D block, spread over the
weight it scales).
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: nibble i of a word holds column AWQ_ORDER[i] of its eight
AWQ_UNDO = tuple(AWQ_ORDER.index(k) for k in range(8))  # column k of the eight sits in nibble AWQ_UNDO[k]


def unpack_int32(packed: torch.Tensor, bits: int, count: int, dim: int) -> torch.Tensor:
    """The unsigned ``bits``-bit codes packed densely along ``dim`` of an int32 tensor: code i occupies bits
    ``i*bits`` to ``i*bits + bits - 1`` of the run of words (little-endian: bit 0 of word w is bit 32*w), so
    a code may straddle two words when 32 is not a multiple of ``bits``. Returns ``count`` codes along ``dim``
    as int32 (values 0 .. 2**bits - 1)."""
    if not 1 <= bits <= 8:
        raise ValueError(f"packed codes of {bits} bits: expected 1 to 8")
    if 32 % bits == 0:  # whole codes in each word: shift in int32, one code-sized array (no int64 gathers)
        shifts = torch.arange(0, 32, bits, dtype=torch.int32)
        words = packed.movedim(dim, -1).to(torch.int32)
        codes = (words.unsqueeze(-1) >> shifts).bitwise_and_((1 << bits) - 1)  # the sign bits shifted in: masked
        return codes.reshape(*words.shape[:-1], -1)[..., :count].movedim(-1, dim)
    words = packed.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    starts = torch.arange(count, dtype=torch.int64) * bits
    first, shift = starts // 32, starts % 32
    codes = words[..., first] >> shift
    straddle = shift + bits > 32
    if bool(straddle.any()):
        nxt = torch.where(straddle, first + 1, first).clamp(max=words.shape[-1] - 1)
        high = words[..., nxt] << (32 - shift)
        codes = torch.where(straddle, codes | high, codes)
    return (codes & ((1 << bits) - 1)).to(torch.int32).movedim(-1, dim)


def awq_columns(codes: torch.Tensor) -> torch.Tensor:
    """AutoAWQ GEMM's columns in their true order: ``codes`` unpacked nibble by nibble along the last dim (eight
    per word) hold each word's eight columns in :data:`AWQ_ORDER`; this puts column k of each eight back at k."""
    cols = codes.shape[-1]
    index = (torch.arange(cols // 8).unsqueeze(1) * 8 + torch.tensor(AWQ_UNDO)).reshape(-1)
    return codes[..., index]


def expand_groups(scale: torch.Tensor, group_of_column: torch.Tensor) -> torch.Tensor:
    """A per-group scale ``[rows, groups]`` spread over the columns: column c takes group ``group_of_column[c]``."""
    return scale.index_select(-1, group_of_column)


def contiguous_groups(columns: int, group_size: int) -> torch.Tensor:
    """Column c's group when columns are grouped ``group_size`` at a time in order (c // group_size)."""
    return torch.arange(columns) // group_size


def expand_blocks(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """A per-block scale ``[ceil(rows/bh), ceil(cols/bw)]`` spread over a ``rows x cols`` weight (the last blocks
    may be partial)."""
    rows, cols = shape
    return scale.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]


def blocks_needed(length: int, block: int) -> int:
    """How many blocks of ``block`` cover ``length`` (the last one may be partial)."""
    return -(-length // block)
