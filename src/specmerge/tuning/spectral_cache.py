"""The spectral cache: each spectral layer decomposed once, so that any filter setting is a re-synthesis.

For every tensor a spectral method merges (SWUDI, SWUDI-A, the filter family, D C^+: methods registered
``spectral=True``) the cache stores what the filter step (:func:`specmerge.linalg.solve.solve`) needs besides the
filter: the spectrum of C (eigenvalues as computed, eigenvectors Q, the resolution floor), and per start tau_init
the start itself, ||D||_F, ||tau_init||_F and the right-hand sides B Q = (D - tau_init C) Q. A setting (filter, r,
t, rank rule, scale) is then two products per layer, with no eigendecomposition and no expert read: the same
arithmetic on the same numbers as a fresh merge, so the same bits (``tests/test_spectral_cache.py``; the block
structure of B Q in :class:`~specmerge.linalg.solve.Projection` makes that hold whatever BLAS does with widths).
Settings whose filter keeps leading directions take the partial route where it pays (issue 23): their entry is the
``partial`` spectrum, the reduction of C with every eigenvalue, and per start what the anticipated counts of kept
eigenvectors need (:func:`partial_columns`): B itself for counts on the B route, the columns B Q of each count on the
product route (:mod:`specmerge.linalg.projection`); each setting computes the eigenvectors it keeps from the
reduction, as a fresh merge does (no eigendecomposition, no expert read). A count not anticipated misses
(ProjectionMissing) and that layer is merged from the stack.

An entry is keyed by the content of its inputs (the base's and every expert's bytes for that tensor, their dtypes
and shapes), the compute dtype, the device type, the orientation and a hash of the code that computes it: a changed
input, dtype or version makes a new key, never a stale hit. Layout: ``<root>/<key[:2]>/<key>/`` holding
``spectrum.safetensors`` and ``spectrum-<tau_init>.safetensors`` (plus ``accurate*`` when a filter needed the SVD
spectrum), each written to a temporary name and renamed. Size per layer (float32): Q (d_in x m), and per start B Q
(d_out x m) and tau_init (d_out x d_in), m = min(N d_out, d_in) (a partial entry: the d_in x d_in reflectors, and
per start B and tau_init; the product route's columns, fewer than d_in per count where that route pays, are not
counted): :func:`estimate_bytes`, printed before a build.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from specmerge.io.views.task_vectors import TaskVector
from specmerge.linalg.eigensolver import Reduction
from specmerge.linalg.projection import Projection
from specmerge.linalg.quadratic import TauInit
from specmerge.linalg.solve import FreshLayer, Kept, ProjectionMissing, leading_count, solve_count, wants_partial
from specmerge.linalg.spectrum import Spectrum
from specmerge.methods import get_method
from specmerge.pipeline.plan.rules import TensorPlan

FORMAT = "specmerge-spectral-cache/1"
# eigh(C) or the SVD of M as decompose() chose; the SVD one when forced; the partial one (a reduction of C) for top-K
SPECTRUM_KINDS = ("spectrum", "accurate", "partial")


def code_key() -> str:
    """A hash of the code whose results the cache stores (the linear algebra and the task-vector stack) and torch."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256(torch.__version__.encode())
    for file in [*sorted((root / "linalg").glob("*.py")), root / "io" / "views" / "task_vectors.py"]:
        digest.update(file.name.encode())
        digest.update(file.read_bytes())
    return digest.hexdigest()[:16]


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def content_key(
    entry: TensorPlan,
    base_tensor: torch.Tensor,
    values: Sequence[TaskVector],
    *,
    compute_dtype: torch.dtype,
    device: torch.device,
    code: str,
) -> str:
    """The key of one layer's entry: every byte of its inputs, their kinds, dtypes and shapes, how it is computed."""
    digest = hashlib.sha256()
    header = [FORMAT, code, str(compute_dtype), device.type, entry.transposed, len(values)]
    digest.update(json.dumps(header).encode())
    for value in [base_tensor, *values]:
        tensors = (value,) if isinstance(value, torch.Tensor) else value.tensors()
        extra = getattr(getattr(value, "delta", None), "scale", None)
        digest.update(json.dumps([getattr(value, "kind", "base"), extra, getattr(value, "shape", None)]).encode())
        for tensor in tensors:
            digest.update(json.dumps([str(tensor.dtype), list(tensor.shape)]).encode())
            digest.update(_tensor_bytes(tensor))
    return digest.hexdigest()


def cacheable(entry: TensorPlan, kinds: Sequence[str]) -> bool:
    """Whether ``entry`` is merged by a spectral method on a stack (the ``dense`` route): what the cache serves.
    LoRA experts merged on their factors (all low-rank) are small and are merged the plain way."""
    if entry.action != "merge" or len(entry.shape) != 2 or not get_method(entry.method).spectral:
        return False
    return any(kind == "dense" for kind in kinds)


def spectrum_kinds(entry: TensorPlan, kept: Iterable[Kept]) -> list[str]:
    """The spectra the settings ask of this layer (``kept``: what each setting's filter keeps): partial for a top-K
    filter where that pays, else full ("spectrum")."""
    d_in = entry.shape[0] if entry.transposed else entry.shape[1]
    return sorted({spectrum_kind(False, wants_partial(k, d_in, d_in)) for k in kept})


def estimate_bytes(
    entries: Iterable[TensorPlan],
    n_experts: int,
    tau_inits: Iterable[str],
    itemsize: int = 4,
    kept: Iterable[Kept] = (None,),
) -> int:
    """Bytes an entry set takes in the cache (all N experts non-zero; the SVD spectrum not counted): per full spectrum
    Q and per start B Q and tau_init; per partial one the reflectors and per start B and tau_init."""
    starts, kept = list(tau_inits), list(kept)
    total = 0
    for entry in entries:
        d_out, d_in = entry.shape[::-1] if entry.transposed else entry.shape
        m = min(n_experts * d_out, d_in)
        for kind in spectrum_kinds(entry, kept):
            width = d_in if kind == "partial" else m
            total += d_in * width + 4 * d_in + sum(d_out * width + (0 if s == "zero" else d_out * d_in) for s in starts)
    return total * itemsize


@dataclass(frozen=True)
class CachedLayer:
    """One layer's stored projections (:class:`~specmerge.linalg.solve.LayerProjections`), loaded when first asked
    for, on ``device``. A start or spectrum not stored raises :class:`~specmerge.linalg.solve.ProjectionMissing`."""

    folder: Path
    device: torch.device
    resident: bool = False  # keep what was loaded (for a tune's many settings, when memory allows)
    _loaded: dict[tuple[str, str], Projection] = field(default_factory=dict, repr=False, compare=False)

    @functools.cached_property
    def _meta(self) -> dict[str, Any]:
        return json.loads((self.folder / "layer.json").read_text())

    @property
    def n_experts(self) -> int:
        return int(self._meta["n_experts"])

    @property
    def n_total(self) -> int:
        return int(self._meta["n_total"])

    def zeros(self) -> torch.Tensor:
        meta = self._meta
        return torch.zeros(meta["shape"], dtype=getattr(torch, meta["dtype"]), device=self.device)

    def wants_partial(self, kept: Kept) -> bool:
        d_in = self._meta["shape"][1]
        return wants_partial(kept, d_in, d_in)

    def projection(
        self, tau_init: TauInit, *, accurate: bool = False, partial: bool = False, leading: int | None = None
    ) -> Projection:
        kind = spectrum_kind(accurate, partial)  # the cache stores no accurate spectrum: those merge from the stack
        if (kind, tau_init) in self._loaded:
            return self._loaded[kind, tau_init]
        p = self._load(kind, tau_init)
        if self.resident:
            self._loaded[kind, tau_init] = p
        return p

    def release(self) -> None:
        """Drop the projections kept in memory."""
        self._loaded.clear()

    @property
    def held(self) -> int:
        """How many projections this layer keeps in memory (resident: each one loaded)."""
        return len(self._loaded)

    def _load(self, kind: str, tau_init: str) -> Projection:
        spectrum_file, start_file = self.folder / f"{kind}.safetensors", self.folder / f"{kind}-{tau_init}.safetensors"
        if not (spectrum_file.is_file() and start_file.is_file()):
            raise ProjectionMissing(f"{self.folder.name}: no {kind} projection for tau_init={tau_init}")
        spectrum = _read_spectrum(spectrum_file, self.device)
        tensors, meta = _read(start_file, self.device)
        start, d_norm, start_norm = tensors.get("start"), meta.get("d_norm"), float(meta["start_norm"])
        sizes = {"n_experts": self.n_experts, "n_rows": int(self._meta["shape"][0])}
        sizes["d_norm_estimate"] = meta.get("d_norm_estimate")
        if spectrum.partial:  # the vectors are computed per K, as in a fresh merge: B, or the columns per count
            counted = {int(name.removeprefix(COUNTED)): t for name, t in tensors.items() if name.startswith(COUNTED)}
            return Projection(spectrum, start, d_norm, start_norm, **sizes, residual=tensors.get("residual"),
                              counted=counted)  # fmt: skip
        return Projection(spectrum, start, d_norm, start_norm, **sizes, held=tensors["projected"])


class SpectralCache:
    """A folder of layer entries (see the module docstring); ``layer(key)`` opens one, ``store`` writes one."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def folder(self, key: str) -> Path:
        return self.root / key[:2] / key

    def has(self, key: str, tau_inits: Iterable[str], kind: str = "spectrum") -> bool:
        """Whether the entry ``key`` holds the ``kind`` spectrum and the projections of ``tau_inits`` (or is a layer
        without a non-zero expert, which needs none)."""
        folder = self.folder(key)
        if folder.is_symlink() or not _regular(folder / "layer.json"):
            return False
        if not json.loads((folder / "layer.json").read_text())["n_experts"]:
            return True
        needed = [f"{kind}.safetensors", *(f"{kind}-{s}.safetensors" for s in tau_inits)]
        return all(_regular(folder / name) for name in needed)

    def layer(self, key: str, device: torch.device, *, resident: bool = False) -> CachedLayer:
        return CachedLayer(self.folder(key), device, resident)

    def write(self, key: str, files: dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]], meta: dict) -> int:
        """Write one entry's files (:func:`entry_files`) under ``key``, each atomically; return the bytes written."""
        folder = self.folder(key)
        if folder.is_symlink():
            raise ValueError(f"spectral cache entry {folder} is a symbolic link: delete it; the cache writes only its "
                             "own folders")  # fmt: skip
        folder.mkdir(parents=True, exist_ok=True)
        written = sum(_write(folder / name, tensors, extra) for name, (tensors, extra) in files.items())
        if not (folder / "layer.json").is_file():
            _atomic_write(folder / "layer.json", json.dumps({"format": FORMAT, **meta}).encode())
        return written


def spectrum_kind(accurate: bool, partial: bool) -> str:
    """The name of the spectrum a merge asks for: the SVD one when ``accurate``, else partial or full."""
    return "accurate" if accurate else "partial" if partial else "spectrum"


COUNTED = "projected-"  # a partial entry's columns B Q of the leading <count> eigenvectors (product route)


def entry_files(
    layer: FreshLayer,
    tau_inits: Iterable[str],
    *,
    accurate: bool = False,
    partial: bool = False,
    kept: Iterable[Kept] = (),
) -> tuple[dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]], dict[str, Any]]:
    """What the cache stores of a layer: its spectrum and, per start, B Q for every column, tau_init and the norms;
    and the layer's facts (experts, shape, dtype). A layer without a non-zero expert stores only the facts.

    Of a partial spectrum, whose vectors are computed per K, each start stores what the filters keeping ``kept``
    ask for (:func:`partial_columns`): B itself for the counts on the B route, the columns of each count on the
    product route (:mod:`specmerge.linalg.projection`)."""
    zeros = layer.zeros()
    meta = {"n_experts": layer.n_experts, "n_total": layer.n_total, "shape": list(zeros.shape),
            "dtype": str(zeros.dtype).removeprefix("torch.")}  # fmt: skip
    files: dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]] = {}
    if not layer.n_experts:
        return files, meta
    kind = spectrum_kind(accurate, partial)
    for start in tau_inits:
        p = layer.projection(start, accurate=accurate, partial=partial)
        files.setdefault(f"{kind}.safetensors", _spectrum_tensors(p.spectrum))
        if p.spectrum.partial:
            columns, norms = partial_columns(p, kept)
        else:
            columns, norms = {"projected": p.all_columns()}, {"d_norm": p.fresh.d_norm}
        tensors = columns | ({} if p.start is None else {"start": p.start})
        files[f"{kind}-{start}.safetensors"] = (tensors, {**norms, "start_norm": p.start_norm})
    return files, meta


def partial_columns(p: Projection, kept: Iterable[Kept]) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """What a fresh partial projection's settings need stored, and the norms of D they read: for each count
    :func:`~specmerge.linalg.solve.solve` will ask of it (one per filter keeping ``kept``; K = 0 asks none), B where
    that count is on the B route, its columns where it is on the product route. A count not anticipated here raises
    ProjectionMissing on the product route (the layer is then merged from the stack), or wherever B was not needed."""
    spectrum, counts = p.spectrum, set()
    for k in kept:
        K = leading_count(k, spectrum)
        if K:
            counts.add(spectrum.basis_count(solve_count(spectrum, K)))
    columns = {f"{COUNTED}{c}": p.all_columns(c) for c in sorted(counts) if p.uses_product(c)}
    norms = {}
    if any(not p.uses_product(c) for c in counts):
        columns["residual"] = p.fresh.B
    if any(not p.estimates_d_norm(c) for c in counts):
        norms["d_norm"] = p.fresh.d_norm
    if any(p.estimates_d_norm(c) for c in counts):
        norms["d_norm_estimate"] = p.fresh.d_norm_estimate
    return columns, norms


def _spectrum_tensors(spectrum: Spectrum) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    if spectrum.partial:
        tensors = {"eigenvalues": spectrum.eigenvalues, **spectrum.reduction.tensors()}
    else:
        tensors = {"eigenvalues": spectrum.eigenvalues, "vectors": spectrum.vectors}
    if spectrum.computed is not None:
        tensors["computed"] = spectrum.computed
    meta = {"n_rows": spectrum.n_rows, "n_cols": spectrum.n_cols, "floor": spectrum.floor, "error": spectrum.error}
    meta["accurate"] = spectrum.accurate
    return tensors, meta


def _read_spectrum(path: Path, device: torch.device) -> Spectrum:
    tensors, meta = _read(path, device)
    reduction = Reduction.from_tensors(tensors) if "reflectors" in tensors else None
    return Spectrum(
        tensors["eigenvalues"], tensors.get("vectors"), int(meta["n_rows"]), int(meta["n_cols"]), float(meta["floor"]),
        tensors.get("computed"), bool(meta["accurate"]), reduction, meta.get("error"),
    )  # fmt: skip


def _read(path: Path, device: torch.device) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    if path.is_symlink() or path.parent.is_symlink():
        raise ValueError(f"spectral cache file {path} is reached through a symbolic link: the cache holds only files "
                         "it wrote; delete that entry's folder")  # fmt: skip
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt") as f:
            meta = json.loads((f.metadata() or {}).get("specmerge", "{}"))
        return load_file(path, device=str(device)), meta
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"spectral cache file {path} cannot be read ({err}): delete its folder {path.parent} and "
                         "run again (it is rebuilt from the inputs)") from None  # fmt: skip


def _write(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> int:
    tensors = {name: t.detach().contiguous().cpu() for name, t in tensors.items()}
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".tmp-", suffix=".safetensors", delete=False) as f:
        temporary = Path(f.name)
    try:
        save_file(tensors, temporary, metadata={"specmerge": json.dumps(meta), "format": FORMAT})
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _regular(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def _atomic_write(path: Path, data: bytes) -> None:
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".tmp-", delete=False) as f:
        f.write(data)
    os.replace(f.name, path)
