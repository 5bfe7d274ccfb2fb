"""A frankenmerge's model: decoder layers of several checkpoints stacked into one, renumbered (mergekit's
``slices`` with ``passthrough``).

:func:`stack_layers` maps each tensor of the output to the checkpoint and tensor it is read from: the layers of the
slices in order, renumbered from 0 (layer i of a model is every tensor under ``<prefix>.<i>.``, the prefix being where
its names' first all-digit component sits, ``model.layers`` in a Llama); the tensors before the layers (the input
embeddings) from the first slice's model and those after them (the final norm, the output head) from the last
slice's, as mergekit takes them. :class:`StackedSource` reads the output's tensors under those names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from specmerge.io.formats.protocol import Rows, SourceError, TensorInfo, TensorSource

# Components of the tensors that come before the layers: input embeddings (the rest, outside the layers, come after)
INPUT_COMPONENTS = frozenset(
    {"embed_tokens", "embed_positions", "embed_in", "tok_embeddings", "wte", "wpe", "word_embeddings",
     "position_embeddings", "token_type_embeddings", "embeddings"}
)  # fmt: skip

Slice = tuple[str, int, int]  # (model key, first layer, one past the last layer)


def layer_of(name: str) -> tuple[str, int, str] | None:
    """(prefix, layer index, rest) of a tensor inside numbered layers (``model.layers.3.mlp.up_proj.weight`` ->
    (``model.layers``, 3, ``mlp.up_proj.weight``)); None outside them."""
    parts = name.split(".")
    index = next((k for k, part in enumerate(parts) if part.isdigit()), None)
    if index is None:
        return None
    return ".".join(parts[:index]), int(parts[index]), ".".join(parts[index + 1 :])


def stack_layers(models: Mapping[str, Mapping[str, TensorInfo]], slices: Sequence[Slice]) -> dict[str, tuple[str, str]]:
    """Each output tensor's (model key, tensor name), in output order (before the layers, the layers, after them);
    a :class:`SourceError` naming the model for a slice outside its layers or a model whose layers are not one stack."""
    layers: dict[str, tuple[str, dict[int, list[str]]]] = {}
    for key, infos in models.items():
        prefixes: dict[str, dict[int, list[str]]] = {}
        for name in infos:
            found = layer_of(name)
            if found is not None:
                prefixes.setdefault(found[0], {}).setdefault(found[1], []).append(name)
        if len(prefixes) != 1:
            stacks = sorted(prefixes) or ["none"]
            raise SourceError(
                f"model '{key}': a frankenmerge stacks one stack of numbered layers, and this model has "
                f"{len(prefixes)} ({', '.join(stacks[:3])}): a model with a vision tower or an encoder is not supported"
            )
        prefix, numbered = next(iter(prefixes.items()))
        layers[key] = (prefix, numbered)
    prefixes = {prefix for prefix, _ in layers.values()}
    if len(prefixes) != 1:
        raise SourceError(
            f"the models' layers are under different names ({', '.join(sorted(prefixes))}): one architecture"
        )
    prefix = prefixes.pop()
    out: dict[str, tuple[str, str]] = {}
    first, last = slices[0][0], slices[-1][0]
    outside = {key: [n for n in models[key] if layer_of(n) is None] for key in {first, last}}
    for name in outside[first]:
        if before_layers(name):
            out[name] = (first, name)
    index = 0
    for key, start, stop in slices:
        numbered = layers[key][1]
        if not 0 <= start < stop <= len(numbered) or sorted(numbered) != list(range(len(numbered))):
            raise SourceError(
                f"model '{key}': layer_range [{start}, {stop}] is outside its {len(numbered)} layers (0 to "
                f"{len(numbered)}, the end not included)"
            )
        for layer in range(start, stop):
            for name in numbered[layer]:
                rest = layer_of(name)[2]  # type: ignore[index]
                out[f"{prefix}.{index}.{rest}"] = (key, name)
            index += 1
    for name in outside[last]:
        if not before_layers(name):
            out[name] = (last, name)
    return out


def before_layers(name: str) -> bool:
    """Whether a tensor outside the numbered layers comes before them (an input embedding), not after them."""
    return any(part in INPUT_COMPONENTS for part in name.split("."))


class StackedSource:
    """The output of a frankenmerge as a source: each name read from the model and tensor :func:`stack_layers` maps
    it to. ``path`` is the first slice's model (where the output's config and tokenizer come from)."""

    def __init__(self, sources: Mapping[str, TensorSource], names: Mapping[str, tuple[str, str]], path: Path) -> None:
        self.sources = dict(sources)
        self.names = dict(names)
        self.path = path
        self._infos = {}
        for out, (key, name) in self.names.items():
            info = self.sources[key].infos()[name]
            self._infos[out] = TensorInfo(out, info.shape, info.dtype)

    def infos(self) -> dict[str, TensorInfo]:
        return self._infos

    def load(self, name: str, rows: Rows = None) -> torch.Tensor:
        if name not in self.names:
            raise SourceError(f"{self.path}: no tensor '{name}' in the stacked layers")
        key, source_name = self.names[name]
        return self.sources[key].load(source_name, rows)

    def describe(self) -> str:
        return f"layers stacked from {', '.join(sorted(self.sources))}"

    def files(self) -> list[Path]:
        return [file for source in self.sources.values() for file in source.files()]

    def close(self) -> None:
        """Nothing: the stacked sources are closed by whoever opened them."""
