"""Float32 against float64, specmerge and the paper's algorithm, on many random layers (issue 13, items 19-20).

    python bench/float32_accuracy.py                  # 2,700 layers, the BENCHMARKS.md table
    python bench/float32_accuracy.py --seeds 5        # a quick look
    python bench/float32_accuracy.py --json out.json  # also every layer's errors
    python bench/float32_accuracy.py --routes         # cost and orthogonality of the wide-layer route

Every spectral method runs on each layer (N in {2, 4, 8}; tall 96 x 64, square 64 x 64, wide 24 x 256 with
N d_out < d_in; four conditionings, see ``tests/float32_sweep.py``) in float32 and in float64 on the same
float32 numbers, and so does our re-implementation of the paper's algorithm (``tests/paper_reference.py``,
one eigh of C, h / lambda; not the authors' code). The table gives, per method, the median and worst
relative error ||tau_32 - tau_64|| / ||tau_64|| of each code against its own float64 result, the worst
ratio specmerge / reference with the layer that gives it, and how many layers break the test's criterion
err_specmerge <= max(err_reference, BACKWARD_ERROR * first-order error) (tests/test_float32_accuracy.py).

``--routes`` times, on synthetic float32 layers with N d_out < d_in, eigh(C), the route specmerge took before
(eigh of M M^T, eigenvectors M^T u / sigma) and the one it takes now (Householder QR of M^T, SVD of R),
reports how far each route's eigenvectors are from orthonormal, and times whole merges of one layer
(run it with an older ``PYTHONPATH`` too for before/after).

The accuracy sweep only calls ``specmerge.get_method`` and ``shared_decompositions``, so it also measures older
versions: ``PYTHONPATH=/path/to/old/src python bench/float32_accuracy.py``. Accuracy does not depend on
load; ``--jobs`` only shortens the wall time.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import specmerge
from float32_sweep import BACKWARD_ERROR, CONDITIONING, METHODS, SHAPES, errors, label, layer
from specmerge_bench.inputs import Parser


def one_layer(key: tuple[int, str, str, int]) -> list[dict]:
    torch.set_num_threads(1)
    n, shape, conditioning, seed = key
    rows = []
    for (method, params), e in zip(METHODS, errors(layer(n, shape, conditioning, seed), METHODS), strict=True):
        rows.append(
            {
                "method": label(method, params),
                "layer": f"N={n} {shape} {'x'.join(map(str, SHAPES[shape]))} {conditioning} seed {seed}",
                "specmerge": e.specmerge,
                "reference": e.reference,
                "allowance": BACKWARD_ERROR * e.allowance,
            }
        )
    return rows


def routes(repeats: int = 3) -> None:
    """CPU seconds (process time, one thread, median of ``repeats`` after a warm-up) of the wide-layer routes."""
    import time

    from specmerge.linalg.quadratic import normal_equation
    from specmerge_bench.speed import cpu_name, synthetic_stack

    torch.set_num_threads(1)

    def seconds(fn) -> float:
        fn()
        times = []
        for _ in range(repeats):
            start = time.process_time()
            fn()
            times.append(time.process_time() - start)
        return sorted(times)[len(times) // 2]

    def off_orthonormal(Q: torch.Tensor) -> float:
        Q = Q.double()
        return float((Q.T @ Q - torch.eye(Q.shape[1], dtype=torch.float64)).abs().max())

    print(f"# torch {torch.__version__}, {cpu_name()}, 1 thread, CPU seconds, median of {repeats} after a warm-up")
    print("| layer (float32) | eigh(C) | before: eigh(M M^T), M^T u / sigma | now: QR of M^T, SVD of R |")
    print("|---|---:|---:|---:|")
    for n, d_out, d_in in [(2, 768, 3072), (2, 256, 3072), (8, 96, 1024)]:
        eq = normal_equation(synthetic_stack(n, d_out, d_in))
        full, gram, now = (functools.partial(route, eq) for route in (_eigh_c, _eigh_gram, _decompose))
        print(
            f"| N={n}, {d_out}x{d_in} | {seconds(full):.3f} | {seconds(gram):.3f}"
            f" (max abs(Q^T Q - I) {off_orthonormal(gram()):.1e}) | {seconds(now):.3f}"
            f" ({off_orthonormal(now()):.1e}) |"
        )
    _layer_times(seconds)


def _eigh_c(eq) -> torch.Tensor:
    return torch.linalg.eigh(eq.M.T @ eq.M)[1]


def _eigh_gram(eq) -> torch.Tensor:
    lam, U = torch.linalg.eigh(eq.M @ eq.M.T)
    return (eq.M.T @ U.flip(1)) / lam.flip(0).clamp(min=torch.finfo(lam.dtype).tiny).sqrt()


def _decompose(eq) -> torch.Tensor:
    from specmerge.linalg.spectrum import decompose

    spectrum = decompose(eq)
    return spectrum.vectors if hasattr(spectrum, "vectors") else spectrum.eigenvectors  # older versions


def _layer_times(seconds) -> None:
    """CPU seconds of whole spectral merges per layer (also runs on older versions, for before/after)."""
    from specmerge_bench.speed import synthetic_stack

    print("\n| layer (float32) | swudi_a (psqrt) | swudi | closed_form |")
    print("|---|---:|---:|---:|")
    for n, d_out, d_in in [(2, 768, 3072), (2, 256, 3072), (8, 96, 1024), (8, 3072, 768), (8, 768, 768)]:
        stack = synthetic_stack(n, d_out, d_in)
        methods = ("swudi_a", "swudi", "closed_form")
        times = [seconds(functools.partial(specmerge.get_method(m), stack)) for m in methods]
        print(f"| N={n}, {d_out}x{d_in} | " + " | ".join(f"{t:.3f}" for t in times) + " |")


def table(rows: list[dict]) -> str:
    lines = [
        "| method | specmerge median | specmerge worst | reference median | reference worst |"
        " worst specmerge / reference (layer) | layers over the test's bound |",
        "|---|---:|---:|---:|---:|---|---:|",
    ]
    for name in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == name]
        ours = [r["specmerge"] for r in mine]
        ref = [r["reference"] for r in mine]
        worst = max(mine, key=lambda r: r["specmerge"] / r["reference"])
        over = sum(r["specmerge"] > max(r["reference"], r["allowance"]) for r in mine)
        lines.append(
            f"| {name} | {statistics.median(ours):.1e} | {max(ours):.1e} | {statistics.median(ref):.1e} |"
            f" {max(ref):.1e} | {worst['specmerge'] / worst['reference']:.2f}"
            f" ({worst['layer']}: {worst['specmerge']:.1e} vs {worst['reference']:.1e}) | {over} / {len(mine)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = Parser(
        prog="float32_accuracy.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=75, help="layers per (N, shape, conditioning); 75 gives 2,700")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (one thread each)")
    parser.add_argument("--json", type=Path, help="write every layer's errors here")
    parser.add_argument("--routes", action="store_true", help="time the wide-layer routes instead")
    args = parser.parse_args()
    if args.seeds < 1 or args.jobs < 1:
        parser.error(f"--seeds and --jobs must be at least 1, got {args.seeds} and {args.jobs}")
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"--json {args.json}: folder {args.json.parent} does not exist")
    if args.routes:
        routes()
        return
    keys = list(itertools.product((2, 4, 8), SHAPES, CONDITIONING, range(args.seeds)))
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = [row for chunk in pool.map(one_layer, keys, chunksize=8) for row in chunk]
    print(f"# specmerge from {Path(specmerge.__file__).parent}, torch {torch.__version__}, {len(keys)} layers")
    print(table(rows))
    worst = max(rows, key=lambda r: r["specmerge"] / max(r["reference"], r["allowance"]))
    print(
        f"\nworst against the test's bound: {worst['method']}, {worst['layer']}: specmerge {worst['specmerge']:.2e},"
        f" reference {worst['reference']:.2e}, allowance {worst['allowance']:.2e}"
    )
    if args.json:
        args.json.write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
