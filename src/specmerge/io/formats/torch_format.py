"""The PyTorch pickle reader: ``pytorch_model.bin`` state dicts loaded memory-mapped with ``weights_only=True``.

A pickle that refers to code or to objects other than tensors is refused unloaded: nothing in it runs, and the
message names what it refers to (never torch's advice to load the file unsafely).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from specmerge.io.formats.files import unusable
from specmerge.io.formats.protocol import SourceError, TensorInfo
from specmerge.io.formats.sharded import ShardedSource, truncated


@dataclass
class TorchFile:
    """An open PyTorch checkpoint: its tensors (memory-mapped when the format allows) and the file's size."""

    tensors: dict[str, torch.Tensor]
    size: int


class TorchSource(ShardedSource):
    """PyTorch pickle state dicts (``pytorch_model.bin``), loaded memory-mapped with ``weights_only=True``.

    A file in the legacy (pre-zip) format cannot be memory-mapped and is loaded whole instead. A pickle that
    refers to any code or object other than tensors and plain containers is refused unloaded: nothing in it
    runs, and the message names what it refers to.
    """

    kind = "PyTorch"

    def open_file(self, file: Path) -> TorchFile:
        real = self.real.get(file, file)
        try:
            size = os.stat(real).st_size
            try:
                state = torch.load(real, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as err:
                if "mmap" not in str(err):
                    raise
                state = torch.load(real, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise _pickle_error(file, err) from None
        except OSError as err:
            raise unusable(file, str(file), err) from None
        except Exception as err:  # whatever a damaged or hostile file makes torch raise
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise SourceError(
                f"{file}: not a readable PyTorch checkpoint ({reason}); it may be truncated or corrupt, re-download it"
            ) from None
        if not isinstance(state, dict):
            raise SourceError(f"{file}: holds a {type(state).__name__}, expected a state dict of tensors")
        tensors = {k: v for k, v in state.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
        if not tensors:
            raise SourceError(
                f"{file}: holds no tensors at the top level; if it is a training checkpoint, save model.state_dict()"
            )
        return TorchFile(tensors, size)

    def file_infos(self, file: Path, handle: TorchFile) -> Iterator[TensorInfo]:
        for name, tensor in handle.tensors.items():
            yield TensorInfo(name, tuple(tensor.shape), tensor.dtype)

    def read(self, file: Path, handle: TorchFile, name: str, rows: tuple[int, int] | None) -> torch.Tensor:
        # The tensors are mapped from the file: reading past a new end would kill the process (SIGBUS).
        with contextlib.suppress(OSError):
            size = os.stat(self.real.get(file, file)).st_size
            if size < handle.size:
                raise truncated(file, name, EOFError(f"the file had {handle.size} bytes, now {size}"))
        # A private copy: the stored tensor is memory-mapped and may share storage with others (tied weights).
        tensor = handle.tensors[name] if rows is None else handle.tensors[name][rows[0] : rows[1]]
        return tensor.clone(memory_format=torch.contiguous_format)


_GLOBAL = re.compile(r"GLOBAL\s+([\w.]+)")


def _pickle_error(file: Path, err: Exception) -> SourceError:
    """What torch's weights_only unpickler refused, without its advice to load the file unsafely."""
    text = str(err)
    found = _GLOBAL.search(text)
    if found:
        return SourceError(
            f"{file}: holds code or objects that are not tensors (its pickle calls or builds {found.group(1)}); "
            "it was not loaded and nothing in it ran. If you trust where the file comes from, convert it to "
            "safetensors; otherwise do not use it"
        )
    return SourceError(
        f"{file}: not a readable PyTorch checkpoint ({_unpickling_reason(text)}); it was not loaded. "
        "Re-download it, or convert a file you trust to safetensors"
    )


def _unpickling_reason(text: str) -> str:
    """The informative part of torch's long weights_only error message (never its advice to load unsafely)."""
    match = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\.\s|\n|$)", text)
    if match:
        return match.group(1).strip()
    for line in text.strip().splitlines():
        line = line.strip()
        if line and not line.startswith("Weights only load failed") and "weights_only" not in line:
            return line
    return "the pickle is not a plain state dict"
