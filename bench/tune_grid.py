"""What a 6 r x 6 t SWUDI grid costs through the spectral cache, against separate merges (issue 17).

    python bench/tune_grid.py --models /work/benchdata/llama1b --work /tmp/grid [--device cpu] [--separate 2]

Measured in one run, in this order: the I/O floor of writing one output (the base's tensors, already read, written
by specmerge's shard writer, no fsync, as tune writes its settings), the first full merge (``specmerge merge
--method swudi``, defaults r = 0.65, t = 1300), the grid end to end without evaluation (``specmerge.tune`` with an
evaluation that returns 0 at once: the cache filled, every setting merged from it in passes of ``--batch``
settings, written, and removed), and ``--separate`` settings of the grid merged separately by ``specmerge merge``
(per-call median; 36 x that median stands for 36 calls when fewer are run: say so), compared with the same
settings merged in one pass from the cache (bitwise, max |difference|). Prints a JSON summary.
"""

from __future__ import annotations

import itertools
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from specmerge.io.formats.protocol import TensorInfo
from specmerge.io.formats.sources import open_source
from specmerge.io.output.writer import ShardWriter
from specmerge.pipeline.run.api import merge_recipe
from specmerge.tuning.batch import run_settings
from specmerge.tuning.cache_build import cached_layers
from specmerge.tuning.space import PAPER_GRIDS
from specmerge.tuning.tune import tune
from specmerge_bench.inputs import Parser, model_family

GRID = [
    {"rank_ratio": r, "t": t}
    for r, t in itertools.product(PAPER_GRIDS["swudi"]["rank_ratio"], PAPER_GRIDS["swudi"]["t"])
]


def write_floor(base: Path, out: Path) -> float:
    """Seconds to write the base's tensors (read beforehand) as one model with the shard writer, no fsync."""
    source = open_source(base)
    tensors = {name: source.load(name).clone() for name in source.infos()}
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    start = time.perf_counter()
    infos = [TensorInfo(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    with ShardWriter(out, infos, max_shard_bytes=5 * 10**9, fsync=False) as writer:
        for name, tensor in tensors.items():
            writer.write(name, tensor)
    seconds = time.perf_counter() - start
    shutil.rmtree(out)
    return seconds


def separate(models: Path, out: Path, params: dict, device: str) -> float:
    """One ``specmerge merge`` call (its own process), seconds wall."""
    experts = sorted(p for p in models.iterdir() if p.name.startswith("expert"))
    cmd = [sys.executable, "-m", "specmerge", "merge", str(models / "base"), *map(str, experts), "-o", str(out),
           "--method", "swudi", "--overwrite", "-q", "--no-fsync", "--device", device,
           *itertools.chain.from_iterable(("-p", f"{k}={v}") for k, v in params.items())]  # fmt: skip
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - start


def compare(a: Path, b: Path) -> dict:
    """Tensors bitwise equal, and the largest |difference| (in float32) over the model's shards."""
    files = sorted(p.name for p in a.glob("*.safetensors"))
    equal, total, worst = 0, 0, 0.0
    for name in files:
        x, y = load_file(a / name), load_file(b / name)
        for key in x:
            total += 1
            equal += torch.equal(x[key], y[key])
            worst = max(worst, float((x[key].float() - y[key].float()).abs().max()))
    return {"tensors_equal": equal, "tensors": total, "max_abs_difference": worst}


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, required=True, help="base/ and expert*/ (bench/memory.py generate)")
    parser.add_argument("--work", type=Path, required=True, help="scratch folder (outputs, the cache)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--separate", type=int, default=2, help="settings of the grid merged separately (<= 36)")
    parser.add_argument("--settings", type=int, default=36, help="settings of the grid to run (default all 36)")
    parser.add_argument("--batch", type=int, default=8, help="settings merged per pass (tune --batch)")
    args = parser.parse_args()
    _, experts = model_family(parser, args.models, "expert", generate="python bench/memory.py generate --models DIR")
    if not 0 <= args.separate <= 36 or not 1 <= args.settings <= 36 or args.batch < 1:
        parser.error("--settings is 1-36, --separate 0-36 and --batch at least 1")
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"device": args.device, "torch_threads": torch.get_num_threads(), "experts": len(experts)}
    result["write_floor_s"] = write_floor(args.models / "base", work / "floor")
    print(json.dumps(result), flush=True)
    result["first_merge_s"] = separate(args.models, work / "first", {}, args.device)
    print(json.dumps(result), flush=True)
    recipe = merge_recipe(args.models / "base", experts, method="swudi", device=args.device)
    grid = GRID[: args.settings]
    space = {"rank_ratio": sorted({g["rank_ratio"] for g in grid}), "t": sorted({g["t"] for g in grid}), "scale": [1.0]}
    lines: list[str] = []
    start = time.perf_counter()
    result_tune = tune(recipe, work / "tune", evaluate=lambda folder: 0.0, space=space, batch=args.batch,
                       progress=False, log=lines.append)  # fmt: skip
    result["grid_settings"] = len(result_tune.scores)
    result["grid_total_s (tune end to end, no evaluation)"] = time.perf_counter() - start
    result["tune_log"] = lines
    result["grid_merge_s per setting"] = [round(e.merge_seconds, 2) for e in result_tune.scores]
    result["cache_bytes"] = sum(f.stat().st_size for f in (work / "tune/cache").rglob("*") if f.is_file())
    print(json.dumps(result), flush=True)
    layers = cached_layers(recipe, work / "tune/cache", ["sum"], progress=False, log=lambda line: None)
    ones = [merge_recipe(args.models / "base", experts, method="swudi", device=args.device, params=grid[k])
            for k in range(min(args.separate, len(grid)))]  # fmt: skip
    if ones:
        run_settings(ones, [work / f"grid{k}" for k in range(len(ones))], layers=layers)
    runs = []
    for k in range(min(args.separate, len(grid))):
        runs.append(separate(args.models, work / f"separate{k}", grid[k], args.device))
        result[f"equal_setting{k}"] = compare(work / f"grid{k}", work / f"separate{k}")
    result["separate_s"] = [round(s, 1) for s in runs]
    if runs:
        result["separate_36_s (36 x median)" if len(runs) < 36 else "separate_36_s"] = 36 * statistics.median(runs)
    result["budget_s (first merge + 36 x write floor)"] = result["first_merge_s"] + 36 * result["write_floor_s"]
    print(json.dumps(result, indent=1), flush=True)


if __name__ == "__main__":
    main()
