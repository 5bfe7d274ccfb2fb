"""GGUF files (llama.cpp) as experts: each tensor dequantized on read and named as the base model names it.

A GGUF file names its tensors llama.cpp's way (``blk.0.attn_q.weight``) and stores them in GGML types (F32, F16,
BF16, Q8_0, Q4_0, the K-quants Q4_K/Q5_K/Q6_K, ...), with its dims reversed against torch's. :func:`open_gguf` reads
one with the ``gguf`` package (``pip install 'specmerge[gguf]'``; its dequantizers are llama.cpp's reference, in
numpy) and serves it as a checkpoint in the base's names: the file's ``general.architecture`` and block count
select the ``gguf`` package's own table of Hugging Face names (``TensorNameMap``), and every base tensor is looked up
under its GGUF name. llama.cpp's converter permutes the rows of ``q_proj`` and ``k_proj`` of the ``llama``
architecture for its rotary embedding; they are permuted back (as transformers does when it loads a GGUF file).

A GGUF file is read as an expert only: its names come from the base, which must be a Hugging Face checkpoint (a
GGUF base is refused in one line). A tensor of the file that no base tensor maps to is refused (it would be
dropped), except llama.cpp's computed rope tables. Every problem (not a GGUF file, a header that lies about its
tensors, an unknown architecture or type) is a :class:`~specmerge.io.formats.protocol.SourceError`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from specmerge.io.formats.protocol import Closing, Rows, SourceError, TensorInfo, no_such_tensor

GGUF_SUFFIX = ".gguf"
COMPUTED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")  # not weights
PERMUTED_ARCHS = ("llama",)  # llama.cpp's LlamaModel permutes q/k rows; its other converters do not
MAX_BLOCKS = 4096  # layers: the deepest released models have a few hundred
DENSE = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def gguf_package(path: Path) -> Any:
    try:
        import gguf
    except ImportError:
        raise SourceError(f"{path}: reading GGUF files needs the gguf package: pip install 'specmerge[gguf]'") from None
    return gguf


def reverse_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary permutation of q/k rows: ``heads`` groups of rows, each stored as (half, 2) pairs."""
    rows = weight.shape[0]
    half = rows // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


class GGUFSource(Closing):
    """A GGUF file served in the base's tensor names (see the module docstring)."""

    def __init__(self, path: Path, base_infos: Mapping[str, TensorInfo]) -> None:
        self.path = Path(path)
        self._real = Path(os.path.realpath(self.path))
        gguf = gguf_package(self.path)
        self._gguf = gguf
        try:
            reader = gguf.GGUFReader(self._real)
            self._tensors = {t.name: t for t in reader.tensors}
            fields = reader.fields
            arch = self._field(fields, "general.architecture")
            blocks = int(self._field(fields, f"{arch}.block_count"))
            heads = int(self._field(fields, f"{arch}.attention.head_count", 0))
            kv = int(self._field(fields, f"{arch}.attention.head_count_kv", heads))
        except SourceError:
            raise
        except Exception as err:  # the gguf package raises whatever numpy does on a broken file
            raise SourceError(
                f"{self.path}: not a valid GGUF file ({type(err).__name__}: {err}); re-download it"
            ) from None
        size = os.path.getsize(self._real)
        for tensor in self._tensors.values():
            if tensor.data_offset + tensor.n_bytes > size or tensor.data.nbytes != tensor.n_bytes:
                raise SourceError(
                    f"{self.path}: tensor '{tensor.name}' lies past the file's end (its header says {tensor.n_bytes} "
                    f"bytes at {tensor.data_offset}, the file has {size}); the file is truncated or corrupt"
                )
        self.arch = arch
        if not 0 < blocks <= MAX_BLOCKS:
            raise SourceError(f"{self.path}: the GGUF metadata says {blocks} blocks (layers); the file is corrupt")
        names = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
        if arch not in names:
            raise SourceError(f"{self.path}: GGUF architecture '{arch}' is not one the gguf package knows; upgrade it")
        table = gguf.get_tensor_name_map(names[arch], blocks)
        self._map: dict[str, str] = {}  # base name -> GGUF name
        for name in base_infos:
            found = table.get_name(name, try_suffixes=(".weight", ".bias"))
            if found is not None and found in self._tensors:
                self._map[name] = found
        mapped = set(self._map.values())
        stray = [n for n in self._tensors if n not in mapped and n not in COMPUTED]
        if stray:
            raise SourceError(
                f"{self.path}: GGUF tensor '{stray[0]}' has no counterpart among the base's tensors (architecture "
                f"'{arch}'; {len(stray)} such): is this GGUF file a fine-tune of this base?"
            )
        self._heads = {"q": heads, "k": kv} if arch in PERMUTED_ARCHS else {}
        self._infos = {name: self._info(name, self._tensors[g]) for name, g in self._map.items()}

    def _field(self, fields: Mapping[str, Any], key: str, default: Any = None) -> Any:
        field = fields.get(key)
        if field is None:
            if default is not None:
                return default
            raise SourceError(f"{self.path}: the GGUF metadata has no '{key}'; the file is not a model llama.cpp wrote")
        return field.contents()

    def _info(self, name: str, tensor: Any) -> TensorInfo:
        kind = tensor.tensor_type.name
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        return TensorInfo(name, shape, DENSE.get(kind, torch.float32))

    def infos(self) -> dict[str, TensorInfo]:
        return dict(self._infos)

    def load(self, name: str, rows: Rows = None) -> torch.Tensor:
        if name not in self._map:
            raise no_such_tensor(self.describe(), name, list(self._map))
        tensor = self._tensors[self._map[name]]
        shape = self._infos[name].shape
        data = tensor.data
        kind = tensor.tensor_type.name
        try:
            if kind in DENSE and kind != "BF16":
                values = torch.from_numpy(data.copy()).reshape(shape)
            else:
                values = torch.from_numpy(self._gguf.quants.dequantize(data, tensor.tensor_type)).reshape(shape)
        except (NotImplementedError, ValueError) as err:
            raise SourceError(f"{self.path}: GGUF tensor '{tensor.name}' ({kind}) cannot be read: {err}") from None
        which = self._map[name].split(".")[-2] if "." in self._map[name] else ""
        if which in ("attn_q", "attn_k") and self._heads:
            heads = self._heads[which[-1]]
            if heads < 1 or values.shape[0] % (2 * heads):
                raise SourceError(
                    f"{self.path}: the GGUF metadata's head count {heads} does not divide the {values.shape[0]} rows "
                    f"of '{tensor.name}' into rotary pairs; the file is corrupt"
                )
            values = reverse_permute(values, heads)
        return values if rows is None else values[rows[0] : rows[1]]

    def describe(self) -> str:
        return f"GGUF file {self.path} ({self.arch})"

    def files(self) -> list[Path]:
        return [self._real]

    def close(self) -> None:
        self._tensors = {}


def open_gguf(path: str | os.PathLike, base_infos: Mapping[str, TensorInfo]) -> GGUFSource:
    """A GGUF file as an expert of the base whose tensors are ``base_infos``."""
    return GGUFSource(Path(path), base_infos)
