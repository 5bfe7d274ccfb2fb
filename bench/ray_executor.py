"""The in-process executor against the Ray executor with 1 and 2 workers, on one machine (issue 18).

    python bench/ray_executor.py --models /work/benchdata/llama1b --work /tmp/rx [--method swudi] [--runs ...]

Each configuration merges the same inputs in its own process (so each process's peak memory is its own), one
after the other, in one run:

- ``local``: the in-process streaming executor, torch on every CPU (``--cpus``, default 2) of this machine;
- ``ray1``: a local Ray instance with ``--cpus`` CPUs and one worker asking for all of them (torch threads = CPUs);
- ``ray2``: the same instance size, each task asking for one CPU: ``--cpus`` workers of one thread.

For each: the wall time of the merge (Ray's start and stop timed apart), the driver's peak resident memory, each
Ray worker's, and a hash of the model files. Then Ray's cost per task: empty tasks through the executor's own task
function on the same merge's worker spec (the job already open in the worker), median of ``--tasks``. Prints JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from specmerge_bench.inputs import Parser, model_family

RUNS = ("local", "ray1", "ray2")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            while chunk := f.read(2**24):
                digest.update(chunk)
    return digest.hexdigest()


def _inputs(models: Path) -> tuple[Path, list[Path]]:
    return models / "base", sorted(p for p in models.iterdir() if p.name.startswith("expert"))


def one(args: argparse.Namespace) -> dict:
    """One configuration, in this process."""
    from specmerge.pipeline.run.api import merge

    base, experts = _inputs(args.models)
    out = args.work / args.run
    shutil.rmtree(out, ignore_errors=True)
    result: dict = {"run": args.run}
    options = {"method": args.method, "progress": False, "overwrite": False}
    if args.run == "local":
        start = time.perf_counter()
        report = merge(base, experts, out, threads=args.cpus, **options)
        result["merge_s"] = time.perf_counter() - start
    else:
        import ray

        from specmerge.pipeline.run.ray_executor import RayExecutor

        start = time.perf_counter()
        ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
        result["ray_start_s"] = time.perf_counter() - start
        per_task = args.cpus if args.run == "ray1" else 1
        executor = RayExecutor(cpus_per_task=per_task)
        start = time.perf_counter()
        report = merge(base, experts, out, executor=executor, **options)
        result["merge_s"] = time.perf_counter() - start
        result["executor"] = report["executor"]
        result["task_overhead_ms"] = _task_overhead(ray, base, experts, args)
        start = time.perf_counter()
        ray.shutdown()
        result["ray_stop_s"] = time.perf_counter() - start
    result["driver_peak_rss_bytes"] = _peak_rss()
    result["threads"] = report["threads"]
    result["output_sha256"] = _hash(out)
    shutil.rmtree(out)
    return result


def _task_overhead(ray, base: Path, experts: list[Path], args: argparse.Namespace) -> float:
    """Milliseconds per empty task through the executor's task function, the merge's job open in the workers."""
    from contextlib import ExitStack

    from specmerge.io.output.folder import atomic_directory
    from specmerge.pipeline.plan.prepare import prepare_merge
    from specmerge.pipeline.run.api import merge_recipe, shard_writer
    from specmerge.pipeline.run.jobs import ComputeOptions, ModelJob
    from specmerge.pipeline.run.ray_executor import run_task

    recipe = merge_recipe(base, experts, method=args.method)
    try:
        with ExitStack() as stack, atomic_directory(args.work / "overhead") as folder:
            prepared = prepare_merge(stack, recipe, folder)
            writer = stack.enter_context(shard_writer(prepared, folder, False))
            job = ModelJob(prepared.plan, prepared.base, prepared.experts, writer.write,
                           ComputeOptions.for_recipe(recipe), recipe=recipe, shards=writer)  # fmt: skip
            spec = ray.put(job.remote())
            task = ray.remote(run_task).options(num_cpus=1)
            ray.get([task.remote(spec, [], None) for _ in range(4)])  # the job opened in every worker
            times = []
            for _ in range(args.tasks):
                start = time.perf_counter()
                ray.get(task.remote(spec, [], None))
                times.append(time.perf_counter() - start)
            raise _Done(1000 * statistics.median(times))
    except _Done as done:  # nothing written: the work folder is removed
        return round(done.value, 3)


class _Done(Exception):
    def __init__(self, value: float) -> None:
        self.value = value


def main() -> None:
    parser = Parser(prog="ray_executor.py", description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, required=True, help="a folder with base/ and expert*/")
    parser.add_argument("--work", type=Path, required=True, help="scratch folder for the outputs")
    parser.add_argument("--method", default="swudi")
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    parser.add_argument("--tasks", type=int, default=200, help="empty tasks timed for the per-task cost")
    parser.add_argument("--run", choices=RUNS, help=argparse.SUPPRESS)  # one configuration, in this process
    args = parser.parse_args()
    model_family(parser, args.models, "expert", generate="python bench/memory.py generate --models DIR")
    if importlib.util.find_spec("ray") is None:
        parser.error("this benchmark needs Ray: pip install 'specmerge[ray]'")
    args.work.mkdir(parents=True, exist_ok=True)
    if args.run:
        print(json.dumps(one(args)))
        return
    results = []
    for run in args.runs:
        command = [sys.executable, __file__, "--models", str(args.models), "--work", str(args.work), "--method",
                   args.method, "--cpus", str(args.cpus), "--tasks", str(args.tasks), "--run", run]  # fmt: skip
        done = subprocess.run(command, check=True, capture_output=True, text=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(results[-1]), flush=True)
    print(json.dumps({"method": args.method, "cpus": args.cpus, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
