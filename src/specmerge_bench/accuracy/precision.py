"""The accuracy benchmark's forward precision: bfloat16 autocast where the CPU runs bf16 natively, float32 elsewhere.

Under bfloat16 autocast MiniLM's forward is about 4x faster than float32 on a CPU with native bf16 (AVX512-BF16,
AMX), and 7x slower on one without (AVX2 only), which emulates every bf16 operation (issue 21: 14.7 s against
2.1 s for 256 sentences on a 2-core EPYC). ``auto`` reads the CPU's own feature flags (:func:`native_bf16`):
oneDNN's check (``torch.ops.mkldnn._is_mkldnn_bf16_supported``, ideep's ``has_bf16_type_support``: an
AVX512-core or AVX-NE-CONVERT CPU) is true where bf16 is only emulated too, and
``torch.backends.cpu.get_cpu_capability`` says only "AVX2" or "AVX512".

One precision holds for a whole run (:func:`using`): probes, experts, scores and AdaMerging are fitted, trained
and scored with the same setting. Every cache key and results folder holds :func:`tag` (the precision and the
CPU capability), so results of one precision are never read as the other's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})  # x86's AVX512-BF16 and AMX-BF16; ARM's BF16
PRECISIONS = ("auto", "bfloat16", "float32")
_current = ["bfloat16"]  # the precision in force (the library functions' default when none is given)


def cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them in :data:`CPUINFO` (``flags`` on x86, ``Features`` on ARM); empty
    where that file cannot be read (another OS)."""
    try:
        text = CPUINFO.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return set()
    found: set[str] = set()
    for line in text.splitlines():
        key, colon, value = line.partition(":")
        if colon and key.strip() in ("flags", "Features"):
            found.update(value.split())
    return found


def native_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively: AVX512-BF16 or AMX-BF16 on x86, FEAT_BF16 on ARM, by
    :func:`cpu_flags`. False (float32) where the flags cannot be read: on an OS other than Linux (macOS, Windows)."""
    return bool(cpu_flags() & NATIVE_BF16_FLAGS)


def resolve(choice: str) -> str:
    """``bfloat16`` or ``float32``: ``choice`` itself, or for ``auto`` bfloat16 where :func:`native_bf16`."""
    if choice not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {choice!r}")
    if choice == "auto":
        return "bfloat16" if native_bf16() else "float32"
    return choice


def choose(choice: str) -> str:
    """Make ``choice`` (resolved) the precision in force for this process (a script's whole run); the name."""
    _current[0] = resolve(choice)
    return _current[0]


@contextmanager
def using(choice: str) -> Iterator[str]:
    """Run the block with ``choice`` (resolved) as the precision in force; yields the resolved name."""
    previous = _current[0]
    try:
        yield choose(choice)
    finally:
        _current[0] = previous


def current() -> str:
    return _current[0]


def autocast(given: bool | None = None) -> bool:
    """Whether a forward runs under bfloat16 autocast: ``given`` when a caller says so, else the precision in force."""
    return (current() == "bfloat16") if given is None else given


def tag() -> str:
    """The precision in force and this CPU's capability, e.g. ``float32-AVX2``: part of every cache key."""
    return f"{current()}-{torch.backends.cpu.get_cpu_capability()}"
