"""The spectral cache: re-synthesis from stored projections equals a fresh merge, bit for bit (issue 17).

Every spectral setting of the paper's grids (SWUDI r x t x s, SWUDI-A's rules x s, D C+, the filter family) is merged
from a stack and from its cached layer on tall, square and wide layers (eigh(C) and SVD routes), and must give the
same bits: the filter step is the same code on the same numbers (``specmerge.linalg.solve.Projection``). Then
whole models: a merge from the cache writes the same files as ``specmerge merge``, and keys follow content.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specmerge.linalg.solve import FreshLayer, ProjectionMissing
from specmerge.methods import get_method
from specmerge.pipeline.run.api import merge_recipe, run_recipe
from specmerge.tuning.cache_build import cached_layers
from specmerge.tuning.space import PAPER_GRIDS, PAPER_SCALES
from specmerge.tuning.spectral_cache import SpectralCache, entry_files

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import build_family


@pytest.fixture(autouse=True)
def one_thread():
    """Both sides run in this process with the same thread count; one keeps BLAS's order fixed."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def stack(n: int, d_out: int, d_in: int, seed: int, noise: float = 1e-3) -> torch.Tensor:
    """Task vectors with a shared low-rank part, an own one and noise: a spectrum with a head and a tail."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(d_out, 4, generator=g) @ torch.randn(4, d_in, generator=g)
    own = [torch.randn(d_out, 3, generator=g) @ torch.randn(3, d_in, generator=g) for _ in range(n)]
    return torch.stack([0.02 * (shared + o) + noise * torch.randn(d_out, d_in, generator=g) for o in own])


def cached(tmp_path: Path, tv: torch.Tensor, starts, *, accurate: bool = False, partial: bool = False):
    cache = SpectralCache(tmp_path / "cache")
    layer = FreshLayer(tv)
    files, meta = entry_files(layer, starts)
    cache.write("ab" * 32, files, meta)
    if accurate:
        cache.write("ab" * 32, *entry_files(layer, starts, accurate=True))
    if partial:  # the counts that every setting below keeps, as tune passes them
        cache.write("ab" * 32, *entry_files(layer, starts, partial=True, kept=settings_kept(tv.shape[0])))
    return cache.layer("ab" * 32, torch.device("cpu"))


def settings_kept(n: int) -> list:
    from specmerge.methods.spectral import kept_directions

    return [kept_directions(name, get_method(name).validate(params, n)) for name, params in settings()]


@pytest.fixture(params=["eigh", "partial"])
def route(request, monkeypatch):
    """Top-K settings on eigh(C) as always on small layers, or on the partial eigensolver (its size floor lowered
    so these small layers take it: the reduction, K vectors by MRRR or all by divide and conquer)."""
    if request.param == "partial":
        from specmerge.linalg import eigensolver

        monkeypatch.setattr(eigensolver, "PARTIAL_MIN_SIZE", 8)
    return request.param


def settings():
    grid = PAPER_GRIDS["swudi"]
    for r, t, s in itertools.product(grid["rank_ratio"], grid["t"], PAPER_SCALES):
        yield "swudi", {"rank_ratio": r, "t": t, "scale": s}
    for rule, s in itertools.product(("psqrt", "gavish_donoho", "participation"), PAPER_SCALES):
        yield "swudi_a", {"rule": rule, "scale": s}
    for start in ("sum", "mean", "zero"):
        yield "swudi", {"tau_init": start}
        yield "closed_form", {"tau_init": start}
        for filt in ("exponential", "landweber", "tikhonov", "pinv"):
            yield "spectral_filter", {"filter": filt, "tau_init": start, "rank": "ratio", "rank_ratio": 0.7}
        yield "spectral_filter", {"filter": "exponential", "tau_init": start, "rank": "psqrt"}


# (N, d_out, d_in, noise): eigh(C) (tall, square, broad: d_out < d_in <= N d_out, where the product route forms
# D Q without D for small counts), the SVD of M (wide), and a rank-deficient tall layer whose pseudoinverse needs the
# SVD spectrum too (stored as "accurate")
SHAPES = {
    "tall": (3, 40, 24, 1e-3),
    "square": (4, 32, 32, 1e-3),
    "broad": (4, 16, 40, 1e-3),
    "wide": (2, 8, 40, 1e-3),
    "deficient": (3, 40, 24, 0),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_spectral_setting_of_the_papers_grids_is_bit_for_bit_a_fresh_merge(tmp_path, shape, route):
    n, d_out, d_in, noise = SHAPES[shape]
    tv = stack(n, d_out, d_in, seed=len(shape), noise=noise)
    partial = route == "partial"
    plain, uses_svd = cached(tmp_path / "plain", tv, ["sum", "mean", "zero"], partial=partial), []
    layer = cached(tmp_path, tv, ["sum", "mean", "zero"], accurate=True, partial=partial)
    checked = 0
    for name, params in settings():
        method = get_method(name)
        fresh = method(tv, **params)
        again = method.fn(layer, **method.validate(params, tv.shape[0]), **method.fixed)
        assert torch.equal(fresh.delta, again.delta), (shape, name, params)
        assert fresh.diagnostics == again.diagnostics, (shape, name, params)
        checked += 1
        try:  # which settings needed the SVD spectrum: a cache without it must miss them
            method.fn(plain, **method.validate(params, tv.shape[0]))
        except ProjectionMissing:
            uses_svd.append(name)
    assert checked == 180 + 15 + 3 * 7
    assert bool(uses_svd) == (shape == "deficient"), uses_svd
    if partial and shape != "wide":  # the eigh(C) route: SWUDI-A's spectrum is the partial one, stored as such
        swudi_a = get_method("swudi_a")
        assert swudi_a.fn(layer, **swudi_a.validate({}, n)).diagnostics == swudi_a(tv).diagnostics
        assert layer.projection("sum", partial=True).spectrum.partial


def test_a_start_or_spectrum_not_stored_is_a_miss_not_a_wrong_answer(tmp_path):
    tv = stack(3, 40, 24, seed=5, noise=0.0)  # tall, rank 13 < 24: eigh(C), and D C+ needs the SVD spectrum
    layer = cached(tmp_path, tv, ["sum"])
    swudi = get_method("swudi")
    assert torch.equal(swudi(tv).delta, swudi.fn(layer, **swudi.validate({}, 3)).delta)
    with pytest.raises(ProjectionMissing):
        swudi.fn(layer, **swudi.validate({"tau_init": "mean"}, 3))
    pinv = get_method("closed_form")
    with pytest.raises(ProjectionMissing):
        pinv.fn(layer, **pinv.validate({"tau_init": "sum"}, 3))


def test_a_layer_without_experts_is_stored_as_zero(tmp_path):
    tv = torch.zeros(3, 8, 6)
    layer = cached(tmp_path, tv, ["sum"])
    result = get_method("swudi").fn(layer, **get_method("swudi").validate({}, 3))
    assert torch.equal(result.delta, torch.zeros(8, 6)) and result.diagnostics["n_experts"] == 0


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("family")
    return build_family(root, "llama", 3)


def test_models_merged_from_the_cache_are_the_files_of_specmerge_merge(tmp_path, family):
    base, experts = family
    recipe = merge_recipe(base, experts, method="swudi", dtype="float32")
    layers = cached_layers(recipe, tmp_path / "cache", ["sum"], progress=False, log=lambda line: None)
    assert len(layers) == 14  # 7 projections x 2 layers
    for params in ({"rank_ratio": 0.55, "t": 300.0, "scale": 0.3}, {"rank_ratio": 0.85, "t": 1800.0}):
        one = merge_recipe(base, experts, method="swudi", dtype="float32", params=params)
        run_recipe(one, tmp_path / "fresh", overwrite=True, progress=False, threads=1)
        run_recipe(one, tmp_path / "cached", overwrite=True, progress=False, threads=1, layers=layers)
        a, b = (load_file(tmp_path / d / "model.safetensors") for d in ("fresh", "cached"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        routes = [
            t["diagnostics"].get("route") for t in json.loads((tmp_path / "cached/report.json").read_text())["tensors"]
        ]
        assert routes.count("cached") == 14


def test_keys_follow_content_so_an_entry_is_never_stale(tmp_path, family):
    base, experts = family
    recipe = merge_recipe(base, experts, method="swudi")
    log: list[str] = []
    first = cached_layers(recipe, tmp_path / "cache", ["sum"], progress=False, log=log.append)
    assert any("14 layers decomposed" in line for line in log)
    log.clear()
    again = cached_layers(recipe, tmp_path / "cache", ["sum"], progress=False, log=log.append)
    assert {k: v.folder for k, v in first.items()} == {k: v.folder for k, v in again.items()}
    assert not any("decomposed" in line for line in log)  # all reused
    other = merge_recipe(base, experts[:2], method="swudi")  # other inputs: other keys, new entries
    third = cached_layers(other, tmp_path / "cache", ["sum"], progress=False, log=log.append)
    assert not {v.folder for v in third.values()} & {v.folder for v in first.values()}
    assert cached_layers(merge_recipe(base, experts, method="ties"), tmp_path / "c2", ["sum"], log=log.append) == {}


def test_a_damaged_or_linked_entry_is_one_line_naming_its_folder(tmp_path):
    tv = stack(3, 12, 8, seed=3)
    layer = cached(tmp_path, tv, ["sum"])
    (layer.folder / "spectrum-sum.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"cannot be read.*delete its folder") as err:
        layer.projection("sum")
    assert "\n" not in str(err.value)
    cache = SpectralCache(tmp_path / "linked")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cache.folder("cd" * 32).parent.mkdir(parents=True)
    cache.folder("cd" * 32).symlink_to(elsewhere)
    assert not cache.has("cd" * 32, ["sum"])
    with pytest.raises(ValueError, match="symbolic link"):
        cache.write("cd" * 32, *entry_files(FreshLayer(tv), ["sum"]))
    assert not list(elsewhere.iterdir())


@pytest.mark.parametrize("shape", ["tall", "square", "wide"])
def test_settings_sharing_their_products_match_fresh_merges_to_float_rounding(tmp_path, shape):
    """SWUDI over the paper's r at each t, each product built on the previous r's (tune --reuse-products): the same
    sum in another order, so equal to 1e-6 relative (float32), and the reuse does happen."""
    from specmerge.linalg.projection import shared_update
    from specmerge.tuning.batch import SharedProducts

    n, d_out, d_in, noise = SHAPES[shape]
    tv = stack(n, d_out, d_in, seed=11, noise=noise)
    layer, swudi = cached(tmp_path, tv, ["sum"]), get_method("swudi")
    grid = PAPER_GRIDS["swudi"]
    for t in grid["t"]:
        shared = SharedProducts(layer)
        for r in grid["rank_ratio"]:
            params = {"rank_ratio": r, "t": t}
            fresh = swudi(tv, **params).delta
            again = swudi.fn(shared, **swudi.validate(params, n)).delta
            assert float((again - fresh).norm()) <= 1e-6 * float(fresh.norm()), (shape, params)
        assert len(shared.projection("sum").shared) == len(grid["rank_ratio"])
    p = layer.projection("sum")
    q = p.sharing()
    Q, P = p.spectrum.vectors, p.held
    small, large = torch.arange(4), torch.arange(7)
    gains = torch.linspace(1.0, 2.0, 7)
    m = Q.shape[1]  # every product from the one set of eigenvectors of a full spectrum
    first = shared_update(q, small, gains[:4], P[:, :4], Q[:, :4], m)
    second = shared_update(q, large, gains, P[:, :7], Q[:, :7], m)  # builds on the first: the last 3 directions added
    assert torch.equal(first, (P[:, :4] * gains[:4]) @ Q[:, :4].T)
    assert torch.allclose(second, (P[:, :7] * gains) @ Q[:, :7].T, rtol=0, atol=1e-6 * float(second.abs().max()))
    third = shared_update(q, large, 2 * gains, P[:, :7], Q[:, :7], m)  # other gains: nothing to build on, one product
    assert torch.equal(third, (P[:, :7] * (2 * gains)) @ Q[:, :7].T)
