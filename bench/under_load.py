"""Whole merges on a shared CPU: specmerge's default thread count against fixed ones, with and without a competitor.

    python bench/under_load.py --models /work/benchdata/llama136m --rounds 5

Layout: MODELS/base/ and MODELS/expert0/ .. expert3/ (Hugging Face folders). Generates them (first run
only, ~1.4 GB; folders already complete are kept) as a 136M-parameter Llama-shaped model in fp16 (hidden
768, MLP 2048, 12 layers, vocab 32000, untied embeddings) and four full-rank experts (base + rank-16
update + noise on every 2-D weight), then times ``specmerge merge`` of the four experts, each job in a fresh process
(interpreter and torch start-up included, as a user sees it), for every method, thread setting and load:

- settings: ``default`` (no option, no OMP_NUM_THREADS), ``--threads 1``, ``--threads 2`` (the count the
  previous default used on a 2-core box) and ``OMP_NUM_THREADS=1`` (the issue's workaround); on request
  (``--settings ... passive2``) also ``--threads 2`` with ``OMP_WAIT_POLICY=PASSIVE`` (idle OpenMP threads
  sleep instead of spinning; it only works when set before torch starts, so specmerge cannot choose it);
- loads: ``none`` (nothing else started), ``python`` (one single-threaded Python busy loop) and ``torch``
  (a float32 matrix-product loop with torch's own default threads, one per core), started a second
  before the job and stopped after it.

Jobs are interleaved within a round (every method x load x setting once, the settings' order rotated by
one each round so that none always runs first, then the next round), an untimed ``sync`` precedes each job,
and the table gives medians over the rounds and the ratio of the default's median to the best setting's
median for each method and load.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from specmerge_bench.inputs import Parser, fail
from specmerge_bench.synthetic import llama_shapes, stable_seed

MODEL = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    vocab_size=32000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
EXPERTS = 4
METHOD_PARAMS = {"task_arithmetic": ["scale=0.3"], "ties": ["density=0.2"]}
SETTINGS = {  # name: (extra arguments, extra environment)
    "default": ([], {}),
    "threads1": (["--threads", "1"], {}),
    "threads2": (["--threads", "2"], {}),
    "omp1": ([], {"OMP_NUM_THREADS": "1"}),
    "passive2": (["--threads", "2"], {"OMP_WAIT_POLICY": "PASSIVE"}),  # not a default setting: see the docstring
}
DEFAULT_SETTINGS = ["default", "threads1", "threads2", "omp1"]
LOADS = {
    "none": None,
    "python": "while True:\n    pass\n",
    "torch": "import torch\na = torch.randn(1024, 1024)\nwhile True:\n    a @ a\n",
}
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def generate(models: Path, experts: int = EXPERTS) -> None:
    """Write base/ and expert0..N-1/ under ``models`` (skipped for folders that are already complete)."""
    import torch

    from specmerge.io.formats.protocol import TensorInfo
    from specmerge.io.output.writer import ShardWriter

    config, shapes = llama_shapes(MODEL)
    infos = [TensorInfo(name, shape, torch.float16) for name, shape in shapes.items()]
    print(f"{sum(i.numel for i in infos) / 1e6:.0f}M parameters, {sum(i.nbytes for i in infos) / 1e9:.2f} GB each")
    for which in ["base", *[f"expert{i}" for i in range(experts)]]:
        folder = models / which
        if (folder / "model.safetensors").is_file() and (folder / "config.json").is_file():
            continue
        tmp = models / f".{which}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        config.save_pretrained(tmp)
        with ShardWriter(tmp, infos, max_shard_bytes=2**40) as writer:
            for name, shape in shapes.items():
                if len(shape) == 1:
                    tensor = torch.ones(shape)
                else:
                    tensor = 0.02 * torch.randn(
                        shape, generator=torch.Generator().manual_seed(stable_seed("base", name))
                    )
                if which != "base":
                    g = torch.Generator().manual_seed(stable_seed(which, name))
                    tensor += 0.002 * torch.randn(shape, generator=g)
                    if len(shape) == 2:
                        low = torch.randn(shape[0], 16, generator=g) @ torch.randn(16, shape[1], generator=g)
                        tensor += 0.0005 * low
                writer.write(name, tensor.half())
        tmp.rename(folder)
        print(f"wrote {folder}", flush=True)


def start_load(kind: str) -> subprocess.Popen | None:
    """Start the competing CPU-bound process (None for ``none``); it runs until :func:`stop_load`."""
    code = LOADS[kind]
    if code is None:
        return None
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL)
    time.sleep(1.0)  # imports done, threads spinning
    if proc.poll() is not None:
        raise RuntimeError(f"the {kind} competitor exited with {proc.returncode}")
    return proc


def stop_load(proc: subprocess.Popen | None) -> None:
    if proc is not None:
        proc.terminate()
        proc.wait()


def run_job(models: Path, out: Path, method: str, setting: str, timeout: float) -> dict:
    """One ``specmerge merge`` in a fresh process: wall seconds, the report's seconds and thread count.

    A job still running after ``timeout`` seconds is stopped and counted as taking ``timeout`` (shown as >).
    """
    args, extra_env = SETTINGS[setting]
    experts = sorted(str(p) for p in models.glob("expert*"))
    params = [x for p in METHOD_PARAMS.get(method, []) for x in ("-p", p)]
    command = [sys.executable, "-m", "specmerge", "merge", str(models / "base"), *experts, "-o", str(out),
               "--overwrite", "-q", "-m", method, *params, "--dtype", "float16", *args]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES} | extra_env
    subprocess.run(["sync"], check=True)
    start = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: specmerge removes its unfinished output
        proc.communicate()
        return {"wall": timeout, "seconds": None, "threads": None, "timed_out": True}
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        lines = stderr.strip().splitlines() or [f"exit status {proc.returncode}"]
        fail("under_load.py", f"specmerge merge -m {method} ({setting}) failed ({proc.returncode}): {lines[-1]}")
    report = json.loads((out / "report.json").read_text())
    return {"wall": wall, "seconds": report["seconds"], "threads": report.get("threads"), "timed_out": False}


def _median(rows: list[dict]) -> tuple[float, bool]:
    """Median wall seconds, and whether it is only a lower bound (a timed-out job at or below the median)."""
    walls = sorted(r["wall"] for r in rows)
    median = statistics.median(walls)
    return median, any(r["timed_out"] and r["wall"] <= median for r in rows)


def table(results: dict, methods: list[str], loads: list[str], settings: list[str]) -> str:
    """Markdown: median wall seconds per setting, the best setting and default / best, per method and load."""
    head = "| method | load | " + " | ".join(settings) + " | best | default / best | threads (default) |"
    lines = [head, "|---|---|" + "---:|" * len(settings) + "---|---:|---:|"]
    for method in methods:
        for load in loads:
            medians = {s: _median(results[method, load, s]) for s in settings}
            best = min(medians, key=lambda s: medians[s][0])
            cells = " | ".join(f"{'>' if bound else ''}{m:.2f}" for m, bound in medians.values())
            if "default" in settings:
                ratio = f"{medians['default'][0] / medians[best][0]:.2f}x"
                used = "/".join(sorted({str(r["threads"]) for r in results[method, load, "default"]}))
            else:
                ratio = used = "-"
            lines.append(f"| {method} | {load} | {cells} | {best} | {ratio} | {used} |")
    return "\n".join(lines)


def machine() -> str:
    """One line about where it ran: CPU model, CPUs usable, torch, load average at the start."""
    import torch

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown CPU")  # fmt: skip
    return (f"{model}, {len(os.sched_getaffinity(0))} CPUs usable, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads by default), load average {os.getloadavg()[0]:.2f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="under_load.py", description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, required=True,
                        help="folder of base/ and expert0/ .. expert3/ (generated on a first run)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="merge output folder (default: MODELS/merged)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--methods", nargs="+", default=["task_arithmetic", "ties"], help="merge methods")
    parser.add_argument("--settings", nargs="+", default=DEFAULT_SETTINGS, choices=list(SETTINGS))
    parser.add_argument("--loads", nargs="+", default=list(LOADS), choices=list(LOADS))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds after which a job is stopped")
    parser.add_argument("--json", type=Path, help="also write every job's numbers here")
    args = parser.parse_args(argv)
    if args.models.exists() and not args.models.is_dir():
        parser.error(f"--models {args.models} is a file; give a folder (the models are generated there)")
    if args.rounds < 1 or not args.timeout > 0:
        parser.error(f"--rounds must be at least 1 and --timeout positive, got {args.rounds} and {args.timeout}")
    from specmerge.methods import all_methods

    unknown = [m for m in args.methods if m not in all_methods()]
    if unknown:
        parser.error(f"--methods: unknown {', '.join(unknown)} (`specmerge methods` lists them)")
    generate(args.models)
    print(machine(), flush=True)
    out = args.out or args.models / "merged"
    results: dict[tuple[str, str, str], list[dict]] = {
        (m, load, s): [] for m in args.methods for load in args.loads for s in args.settings
    }
    for round_ in range(args.rounds):
        for method in args.methods:
            for load in args.loads:
                shift = round_ % len(args.settings)  # rotated each round: no setting always runs first
                for setting in args.settings[shift:] + args.settings[:shift]:
                    competitor = start_load(load)
                    try:
                        row = run_job(args.models, out, method, setting, args.timeout)
                    finally:
                        stop_load(competitor)
                    results[method, load, setting].append(row)
                    merge_s = "timed out" if row["timed_out"] else f"{row['seconds']:.2f} s merge"
                    print(f"round {round_ + 1}: {method} {load} {setting}: {row['wall']:.2f} s wall ({merge_s}, "
                          f"threads {row['threads']})", flush=True)  # fmt: skip
    print()
    print(table(results, args.methods, args.loads, args.settings))
    print()
    for key, rows in results.items():
        print(f"{' '.join(key)}: " + "/".join(f"{'>' * r['timed_out']}{r['wall']:.1f}" for r in rows))
    if args.json:
        args.json.write_text(json.dumps([{"job": list(k), "rows": v} for k, v in results.items()], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
