"""The same mergekit config run by mergekit-yaml and by specmerge (its mergekit dialect): time and peak memory.

    python bench/mergekit_speed.py --models /work/benchdata/llama1b --mergekit /work/mergekit-venv/bin/mergekit-yaml

Inputs: ``MODELS/base`` and ``MODELS/expert0..2`` (``bench/memory.py generate``: TinyLlama-1.1B shapes, fp16, 3 shards
each). For each method one config of a shape people publish is written (slerp with per-filter gradients, ties and
dare_ties with three experts at density 0.5, model_stock of three experts, a passthrough frankenmerge of two
overlapping layer ranges: 32 layers) and run, in its own process, by
``mergekit-yaml CONFIG OUT --lazy-unpickle`` (CPU) and by ``specmerge run CONFIG -o OUT``: the very same file.
``--repeats`` rounds (the two tools interleaved); the median wall time and the largest peak resident set (sampled
every 20 ms from /proc, :class:`specmerge_bench.memory.Sampler`). The page cache is warm (an untimed read of every
input first) and nothing is pending to disk (an untimed ``sync`` before each job). The outputs are compared: the
largest |difference| over every tensor, as a share of that tensor's largest entry, and the share of entries not
equal (random masks differ by construction: dare_ties is compared in no other way here; tests/test_mergekit_corpus.py
checks its distribution; mergekit computes in the config's float16, specmerge in float32, so TIES's trims and sign
elections on float16 deltas, full of equal magnitudes, may keep other entries).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from end_to_end import run_job, warm_page_cache
from specmerge_bench.inputs import Parser, model_family

GIB = 2**30
FILTERED_T = [
    {"filter": "self_attn", "value": [0, 0.5, 0.3, 0.7, 1]},
    {"filter": "mlp", "value": [1, 0.5, 0.7, 0.3, 0]},
    {"value": 0.5},
]


def config(method: str, base: Path, experts: list[Path]) -> dict:
    """A config of the shape people publish for ``method``."""
    common = {"merge_method": method, "base_model": str(base), "dtype": "float16"}
    if method == "slerp":
        models = [{"model": str(base)}, {"model": str(experts[0])}]
        return {**common, "models": models, "parameters": {"t": FILTERED_T}}
    if method in ("ties", "dare_ties"):
        models = [
            {"model": str(e), "parameters": {"weight": w, "density": 0.5}}
            for e, w in zip(experts, (0.5, 0.3, 0.2), strict=True)
        ]
        return {**common, "models": models, "parameters": {"normalize": True}}
    if method == "model_stock":
        return {**common, "models": [{"model": str(base)}, *({"model": str(e)} for e in experts)]}
    if method == "passthrough":  # a frankenmerge: overlapping ranges of two experts' 22 layers, 32 layers in all
        ranges = [(experts[0], [0, 16]), (experts[1], [6, 22])]
        slices = [{"sources": [{"model": str(e), "layer_range": r}]} for e, r in ranges]
        return {"merge_method": method, "slices": slices, "dtype": "float16"}
    raise ValueError(method)


def largest_share(a: Path, b: Path) -> tuple[float, float]:
    """(max over tensors of max |a - b| / max |b|, the share of all entries that are not equal) of two folders."""
    from safetensors import safe_open

    def files(folder: Path) -> dict[str, Path]:
        out = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(file, "pt") as f:
                out.update({k: file for k in f.keys()})  # noqa: SIM118 (safe_open is not a Mapping)
        return out

    left, right = files(a), files(b)
    if set(left) != set(right):
        raise SystemExit(f"{a} and {b} hold different tensors: {sorted(set(left) ^ set(right))[:5]}")
    worst, unequal, total = 0.0, 0, 0
    for name, file in left.items():
        with safe_open(file, "pt") as f:
            x = f.get_tensor(name).double()
        with safe_open(right[name], "pt") as f:
            y = f.get_tensor(name).double()
        worst = max(worst, float((x - y).abs().max() / y.abs().max().clamp(min=1e-30)))
        unequal, total = unequal + int((x != y).sum()), total + x.numel()
    return worst, unequal / total


def main() -> None:
    parser = Parser(prog="mergekit_speed.py", description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, required=True, help="folder of base/ and expert0/ .. expert2/")
    parser.add_argument("--mergekit", type=Path, required=True, help="mergekit-yaml of its own virtualenv")
    parser.add_argument("--repeats", type=int, default=1, help="rounds (default 1)")
    methods = ["slerp", "ties", "dare_ties", "model_stock", "passthrough"]
    parser.add_argument("--methods", nargs="+", default=methods, choices=methods)
    parser.add_argument("--work", type=Path, help="scratch folder for outputs (default: next to the models)")
    args = parser.parse_args()
    base, experts = model_family(parser, args.models, [f"expert{i}" for i in range(3)], generate="bench/memory.py")
    if not (args.mergekit.is_file() and os.access(args.mergekit, os.X_OK)):
        parser.error(f"--mergekit {args.mergekit} is not an executable file")
    work = Path(tempfile.mkdtemp(prefix="mk-speed-", dir=args.work or args.models))
    try:
        warm_page_cache([base, *experts])
        results: dict[tuple[str, str], list[dict]] = {}
        for method in args.methods:
            path = work / f"{method}.yaml"
            path.write_text(json.dumps(config(method, base, experts)))  # JSON is YAML
            jobs = {
                "mergekit": [str(args.mergekit), str(path), str(work / f"{method}-mergekit"), "--lazy-unpickle"],
                "specmerge": [
                    sys.executable,
                    "-m",
                    "specmerge",
                    "run",
                    str(path),
                    "-o",
                    str(work / f"{method}-specmerge"),
                    "-q",
                ],
            }
            for _ in range(args.repeats):
                for tool, command in jobs.items():
                    shutil.rmtree(work / f"{method}-{tool}", ignore_errors=True)
                    subprocess.run(["sync"], check=True)
                    results.setdefault((method, tool), []).append(run_job(command))
            share, unequal = largest_share(work / f"{method}-specmerge", work / f"{method}-mergekit")
            results[(method, "difference")] = [{"share": share, "unequal": unequal}]
            print(f"{method}: done (largest difference {share:.1e} of a tensor's largest entry)", flush=True)
        print(f"\nmodels: {args.models} (base + 3 experts), repeats: {args.repeats}, CPUs: {os.cpu_count()}")
        columns = ["method", "mergekit s", "specmerge s", "speed-up", "mergekit peak RSS GiB", "specmerge peak RSS GiB"]
        print("| " + " | ".join([*columns, "largest difference", "entries not equal"]) + " |")
        print("|---|---|---|---|---|---|---|---|")
        for method in args.methods:
            mk, sm = results[(method, "mergekit")], results[(method, "specmerge")]
            t_mk, t_sm = statistics.median(r["seconds"] for r in mk), statistics.median(r["seconds"] for r in sm)
            rss_mk, rss_sm = max(r["peak_rss"] for r in mk) / GIB, max(r["peak_rss"] for r in sm) / GIB
            difference = results[(method, "difference")][0]
            cells = [method, f"{t_mk:.1f}", f"{t_sm:.1f}", f"{t_mk / t_sm:.2f}x", f"{rss_mk:.2f}", f"{rss_sm:.2f}"]
            print("| " + " | ".join([*cells, f"{difference['share']:.1e}", f"{difference['unequal']:.2%}"]) + " |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
