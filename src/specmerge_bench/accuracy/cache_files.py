"""Files of the accuracy benchmark's cache: keys, atomic publication, JSON records, tokens and probe heads."""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
from torch import Tensor

from specmerge_bench.accuracy.data import sha256_file
from specmerge_bench.accuracy.model import MODEL_FILES, EncodedSplit, Head

StateDict = dict[str, Tensor]


def digest(inputs: object) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


# The code keys below are read once per process: a key names the code the process runs, which an edit of the
# source files while a run goes on (a session working in the same checkout) must not change.


@functools.cache
def code_digest(*functions: Callable) -> str:
    """SHA-256 of the source of the functions (and classes) a stage's output depends on (once per process)."""
    return digest([inspect.getsource(function) for function in functions])


def model_files(folder: Path) -> dict[str, str]:
    return {name: sha256_file(folder / name) for name in MODEL_FILES if (folder / name).is_file()}


def publish(staging: Path, final: Path) -> None:
    """Move a finished staging folder into place (a concurrent identical build may have won: keep that one)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(staging, final)
    except OSError:
        shutil.rmtree(staging)


def staging_folder(final: Path) -> Path:
    staging = final.parent / f".{final.name}.{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def took(cached: bool, seconds: float) -> str:
    return "cached" if cached else f"{seconds:.1f} s"


def write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=1) + "\n", encoding="utf-8")


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def save_encoded(tasks_encoded: Mapping[str, Mapping[str, EncodedSplit]], path: Path) -> None:
    """Write tokenized tasks as safetensors (``<task>/<split>/{input_ids,attention_mask,labels}``; task order in
    the metadata)."""
    tensors = {
        f"{task}/{split}/{field}": getattr(encoded, field).contiguous()
        for task, splits in tasks_encoded.items()
        for split, encoded in splits.items()
        for field in ("input_ids", "attention_mask", "labels")
    }
    safetensors.torch.save_file(tensors, path, metadata={"tasks": json.dumps(list(tasks_encoded))})


def load_encoded(path: str | Path) -> dict[str, dict[str, EncodedSplit]]:
    """Tokenized tasks written by ``save_encoded``: task -> split -> ``EncodedSplit``, tasks in the saved order."""
    with safetensors.safe_open(str(path), framework="pt") as f:
        tasks = json.loads(f.metadata()["tasks"])
        grouped: dict[str, dict[str, dict[str, Tensor]]] = {task: {} for task in tasks}
        for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
            task, split, field = name.split("/")
            grouped[task].setdefault(split, {})[field] = f.get_tensor(name)
    return {
        task: {split: EncodedSplit(**fields) for split, fields in splits.items()} for task, splits in grouped.items()
    }


def save_heads(heads: Mapping[str, Head], path: Path) -> None:
    """Write heads as safetensors (``<task>/weight``, ``<task>/bias``; L2 strengths in the metadata)."""
    tensors = {
        f"{task}/{field}": getattr(head, field).contiguous()
        for task, head in heads.items()
        for field in ("weight", "bias")
    }
    safetensors.torch.save_file(tensors, path, metadata={"l2": json.dumps({t: h.l2 for t, h in heads.items()})})


def load_heads(path: str | Path) -> dict[str, Head]:
    """Heads written by ``save_heads``: task -> ``Head``."""
    with safetensors.safe_open(str(path), framework="pt") as f:
        l2 = json.loads(f.metadata()["l2"])
        return {task: Head(f.get_tensor(f"{task}/weight"), f.get_tensor(f"{task}/bias"), l2[task]) for task in l2}


def load_scoring(built: Mapping[str, Any], model_dir: str | Path | None = None) -> tuple[Any, StateDict, Any, Any]:
    """(base model, a copy of its state dict, encoded tasks, probe heads) for scoring, from ``build_setting``."""
    from specmerge_bench.accuracy import model

    base_model, _ = model.load_base(model_dir)
    base = {k: v.detach().clone() for k, v in base_model.state_dict().items()}
    tasks_encoded = {k: v for path in built["paths"]["tokens"] for k, v in load_encoded(path).items()}
    return base_model, base, tasks_encoded, {k: v for p in built["paths"]["heads"] for k, v in load_heads(p).items()}


def load_experts(built: Mapping[str, Any], seed: int, base: StateDict) -> dict[str, StateDict]:
    """Task -> the seed's expert state dict, with the base's tensor names."""
    folders = built["paths"]["experts"][seed]
    states = {task: safetensors.torch.load_file(Path(folder) / "model.safetensors") for task, folder in folders.items()}
    return {task: {name: state[name] for name in base} for task, state in states.items()}
