"""``tune --reuse-products`` on one layer: SWUDI at the paper's r for a few t, from a spectral cache, with and
without building each filter product on the previous one (issue 17).

    python bench/reuse_products.py [--size 2048] [--times 2]

Prints the seconds of both loops and how many products were built on an earlier one.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

import specmerge.linalg.solve as solve
from specmerge.linalg.solve import FreshLayer
from specmerge.methods import get_method
from specmerge.tuning.batch import SharedProducts
from specmerge.tuning.space import PAPER_GRIDS
from specmerge.tuning.spectral_cache import SpectralCache, entry_files

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_spectral_cache import stack


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=2048, help="d_out = d_in of the layer (4 experts)")
    parser.add_argument("--times", type=int, default=2, help="how many of the paper's t values")
    args = parser.parse_args()
    hits: list[bool] = []
    original = solve.shared_update

    def counting(p, index, inverse, projected, Q):
        before = [mask.clone() for mask, _, _ in p.shared]
        out = original(p, index, inverse, projected, Q)
        hits.append(any(m.any() and not bool((m & ~p.shared[-1][0]).any()) for m in before))
        return out

    solve.shared_update = counting
    with tempfile.TemporaryDirectory() as folder:
        cache = SpectralCache(folder)
        cache.write("ab" * 32, *entry_files(FreshLayer(stack(4, args.size, args.size, seed=1)), ["sum"]))
        layer, swudi = cache.layer("ab" * 32, torch.device("cpu")), get_method("swudi")
        grid = PAPER_GRIDS["swudi"]
        settings = [(t, r) for t in grid["t"][: args.times] for r in grid["rank_ratio"]]
        start = time.perf_counter()
        for t, r in settings:
            swudi.fn(layer, **swudi.validate({"rank_ratio": r, "t": t}, 4))
        whole = time.perf_counter() - start
        start = time.perf_counter()
        for t in grid["t"][: args.times]:
            shared = SharedProducts(layer)
            for r in grid["rank_ratio"]:
                swudi.fn(shared, **swudi.validate({"rank_ratio": r, "t": t}, 4))
        reused = time.perf_counter() - start
    shape = f"{args.size} x {args.size}, 4 experts, {torch.get_num_threads()} threads"
    print(f"{len(settings)} settings, {shape}: one product each {whole:.1f} s, reusing {reused:.1f} s")
    print(f"{sum(hits)} of {len(hits)} products built on an earlier one")


if __name__ == "__main__":
    main()
