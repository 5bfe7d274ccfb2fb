"""Open a checkpoint by its path: pick the reader for a file, a Hugging Face model folder or an index.

``open_source(path)`` accepts a single ``.safetensors`` file, a Hugging Face model folder (sharded
safetensors with ``model.safetensors.index.json``, ``model.safetensors``, ``pytorch_model.bin.index.json``
or ``pytorch_model.bin``), an index file, or a single ``.bin``/``.pt`` state dict, and returns a
:class:`~specmerge.io.formats.protocol.TensorSource` that reads one tensor per ``load(name)``. Every file taken
from a folder, shards named by an index included, is checked by :func:`specmerge.io.formats.files.folder_file`;
``source.files()`` lists the real files a source reads.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from specmerge.io.formats.files import folder_file, regular_file, unusable
from specmerge.io.formats.gguf_format import GGUF_SUFFIX
from specmerge.io.formats.names import (
    ADAPTER_CONFIG,
    ADAPTER_FILES,
    SAFETENSORS_FILE,
    SAFETENSORS_INDEX,
    SAFETENSORS_INDEX_SUFFIX,
    SAFETENSORS_SUFFIX,
    TORCH_FILE,
    TORCH_INDEX,
    TORCH_INDEX_SUFFIX,
    TORCH_SUFFIXES,
)
from specmerge.io.formats.protocol import SourceError, TensorSource
from specmerge.io.formats.safetensors_format import SafetensorsSource
from specmerge.io.formats.sharded import ShardedSource
from specmerge.io.formats.torch_format import TorchSource
from specmerge.io.quant.source import dequantized


def open_source(path: str | os.PathLike) -> TensorSource:
    """Open a checkpoint lazily: a safetensors file, a Hugging Face model folder, an index file or a .bin file.

    A checkpoint whose config.json states a quantization is read as the dense model it stands for
    (:func:`specmerge.io.quant.source.dequantized`); one that holds quantized tensors it cannot read exactly is
    refused here, before any work."""
    path = Path(path).expanduser()
    source = open_stored(path)
    try:
        return dequantized(source, path)
    except BaseException:
        source.close()
        raise


def open_stored(path: Path) -> TensorSource:
    """The reader of the tensors stored at ``path``, as stored (quantized codes included)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        hint = "does not exist; pass a .safetensors file or a Hugging Face model folder"
        raise unusable(path, str(path), err, hint) from None
    if stat.S_ISDIR(mode):
        return _open_folder(path)
    regular_file(path)
    if path.name.endswith(SAFETENSORS_INDEX_SUFFIX):
        return _from_index(path, SafetensorsSource, in_folder=False)
    if path.name.endswith(TORCH_INDEX_SUFFIX):
        return _from_index(path, TorchSource, in_folder=False)
    if path.suffix == SAFETENSORS_SUFFIX:
        return SafetensorsSource(path, [path])
    if path.suffix in TORCH_SUFFIXES:
        return TorchSource(path, [path])
    if path.suffix == GGUF_SUFFIX:
        raise SourceError(
            f"{path}: a GGUF file is read as an expert only, in the names of a base given as a Hugging Face checkpoint "
            "(the GGUF file does not say which names the model's architecture gives its tensors): give the base's "
            "Hugging Face folder"
        )
    raise SourceError(
        f"{path}: unsupported checkpoint file; expected .safetensors, a .safetensors.index.json, .bin or .pt"
    )


def _open_folder(folder: Path) -> TensorSource:
    try:
        names = set(os.listdir(folder))
    except OSError as err:
        raise unusable(folder, str(folder), err) from None
    if SAFETENSORS_INDEX in names:
        return _from_index(folder / SAFETENSORS_INDEX, SafetensorsSource, in_folder=True)
    if SAFETENSORS_FILE in names:
        return SafetensorsSource(folder, [_in_folder(folder, SAFETENSORS_FILE)])
    if TORCH_INDEX in names:
        return _from_index(folder / TORCH_INDEX, TorchSource, in_folder=True)
    if TORCH_FILE in names:
        return TorchSource(folder, [_in_folder(folder, TORCH_FILE)])
    indexes = sorted(name for name in names if name.endswith(SAFETENSORS_INDEX_SUFFIX))
    files = sorted(name for name in names if name.endswith(SAFETENSORS_SUFFIX))
    if len(indexes) == 1:
        return _from_index(folder / indexes[0], SafetensorsSource, in_folder=True)
    if len(indexes) > 1:
        raise SourceError(f"{folder} holds several safetensors indexes ({', '.join(indexes)}); pass one of them")
    if ADAPTER_CONFIG in names:
        raise SourceError(f"{folder} is a PEFT adapter folder ({ADAPTER_CONFIG}), not a full model checkpoint")
    adapter_weights = [f for f in ADAPTER_FILES if f in names]
    if adapter_weights:
        raise SourceError(
            f"{folder} holds {adapter_weights[0]} but no {ADAPTER_CONFIG}: a PEFT adapter needs its config "
            "(rank, alpha, target modules); copy it from where the adapter was saved"
        )
    if len(files) == 1:
        return SafetensorsSource(folder, [_in_folder(folder, files[0])])
    if files:
        shown = ", ".join(files[:5]) + (", ..." if len(files) > 5 else "")
        raise SourceError(
            f"{folder} holds {len(files)} .safetensors files ({shown}) but no {SAFETENSORS_INDEX} saying which "
            "tensor lives where; add the index or pass a single file"
        )
    raise SourceError(
        f"{folder} holds no checkpoint: looked for {SAFETENSORS_INDEX}, {SAFETENSORS_FILE}, {TORCH_INDEX}, "
        f"{TORCH_FILE} and *.safetensors"
    )


def _in_folder(folder: Path, name: str) -> Path:
    """``folder / name``, checked by :func:`folder_file`."""
    folder_file(folder / name, folder)
    return folder / name


def _from_index(index: Path, kind: type[ShardedSource], *, in_folder: bool) -> TensorSource:
    folder = index.parent
    real = folder_file(index, folder) if in_folder else regular_file(index)
    try:
        data = json.loads(real.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or "weight_map" not in data:
            raise KeyError("weight_map")
        weight_map = data["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map is not a mapping of tensor names to file names")
    except OSError as err:
        raise unusable(index, str(index), err) from None
    except (ValueError, KeyError, TypeError, RecursionError) as err:
        detail = "no 'weight_map'" if isinstance(err, KeyError) else str(err)
        raise SourceError(f"{index}: not a valid checkpoint index ({detail}); re-download it") from None
    files: dict[str, Path] = {}  # file name -> path, in order of first appearance
    for name, file_name in weight_map.items():
        if file_name in files:
            continue
        if file_name in ("", ".", "..") or any(c in file_name for c in ("/", "\\", "\0")):
            raise SourceError(
                f"{index}: shard '{file_name}' (holding '{name}') is not a plain file name; shards are read only "
                f"from the index's folder {folder}, so fix the index"
            )
        folder_file(
            folder / file_name,
            folder,
            label=f"{index}: shard {file_name} (holding '{name}')",
            missing=f"is missing from {folder}; download it or fix the index",
        )
        files[file_name] = folder / file_name
    source_path = folder if index.name in (SAFETENSORS_INDEX, TORCH_INDEX) else index
    return kind(source_path, list(files.values()), {name: files[f] for name, f in weight_map.items()}, index=index)
