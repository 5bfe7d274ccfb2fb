"""Peak memory of a whole-model merge vs loading every checkpoint at once.

    python bench/memory.py generate --models /path/to/bench-models    # ~1.1B Llama, fp16, base + 4 experts
    python bench/memory.py generate --models DIR --dtype bfloat16     # the same in bf16
    python bench/memory.py measure --models /path/to/bench-models     # merge and load-all, each in a fresh process

`generate` streams random weights (TinyLlama-1.1B shapes: hidden 2048, MLP 5632, 22 layers, vocab 32000)
into sharded safetensors (1 GB shards + index) with the project's ShardWriter, so it needs little
memory; experts are base + a rank-16 update + small noise on every 2-D weight. Layout written and read:
MODELS/base/ and MODELS/expert0/ .. expert<N-1>/, each a Hugging Face folder (config.json, shards, index).
`measure` runs each job in a child process that samples /proc/self/status every 5 ms after its imports
(:class:`specmerge_bench.memory.Sampler`): peak anonymous memory (RssAnon: tensors, heap) and peak resident
set including file-backed pages (VmRSS: also mmap'd checkpoint pages), both minus the values measured
after imports, plus the kernel's VmHWM.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from specmerge_bench.inputs import Parser, fail, model_family
from specmerge_bench.memory import Sampler
from specmerge_bench.synthetic import llama_shapes, stable_seed

MODEL = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


def generate(models: Path, experts: int, dtype_name: str = "float16") -> None:
    """Write MODELS/base and MODELS/expert0..<experts-1> (TinyLlama-1.1B shapes, fp16 or bf16, 1 GB shards)."""
    import torch

    from specmerge.io.formats.protocol import TensorInfo
    from specmerge.io.output.writer import ShardWriter

    dtype = getattr(torch, dtype_name)
    config, shapes = llama_shapes(MODEL, dtype_name)
    infos = [TensorInfo(name, shape, dtype) for name, shape in shapes.items()]
    params, size = sum(i.numel for i in infos) / 1e9, sum(i.nbytes for i in infos) / 1e9
    print(f"{params:.2f}B parameters, {size:.2f} GB per checkpoint")

    def base_tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if len(shape) == 1:
            return torch.ones(shape, dtype=dtype)
        g = torch.Generator().manual_seed(stable_seed("base", name))
        return (0.02 * torch.randn(shape, generator=g)).to(dtype)

    for which in ["base", *[f"expert{i}" for i in range(experts)]]:
        folder = models / which
        folder.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(folder)
        with ShardWriter(folder, infos, max_shard_bytes=10**9) as writer:
            for name, shape in shapes.items():
                tensor = base_tensor(name, shape)
                if which != "base":
                    g = torch.Generator().manual_seed(stable_seed(which, name))
                    noise = 0.002 * torch.randn(shape, generator=g)
                    if len(shape) == 2:
                        low = torch.randn(shape[0], 16, generator=g) @ torch.randn(16, shape[1], generator=g)
                        noise += 0.002 * low / 4
                    tensor = (tensor.float() + noise).to(dtype)
                writer.write(name, tensor)
        print(f"wrote {folder}", flush=True)


def measure_merge(models: Path, out: Path, method: str) -> dict:
    import torch

    from specmerge.pipeline.run.api import merge

    torch.ones(8) @ torch.ones(8)  # thread pools and allocator up before the baseline
    experts = sorted(p for p in models.iterdir() if p.name.startswith("expert"))
    start = time.perf_counter()
    with Sampler() as sampler:
        report = merge(models / "base", experts, out, method=method, progress=False, overwrite=True)
    return {"job": f"merge {method}", "seconds": time.perf_counter() - start, **sampler.result(),
            "tensors": len(report["tensors"])}  # fmt: skip


def measure_load_all(models: Path) -> dict:
    """Every checkpoint in memory at once, as a merge script that loads state dicts does."""
    import torch
    from safetensors.torch import load

    torch.ones(8) @ torch.ones(8)
    folders = [models / "base", *sorted(p for p in models.iterdir() if p.name.startswith("expert"))]
    start = time.perf_counter()
    with Sampler() as sampler:  # load() copies out of the file's bytes: resident tensors, not a lazy mmap
        state = [
            {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load(f.read_bytes()).items()} for d in folders
        ]
    assert sum(len(s) for s in state) > 0
    return {"job": f"load all {len(folders)} checkpoints", "seconds": time.perf_counter() - start, **sampler.result()}


def checkpoint_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def workspace_bytes(models: Path) -> tuple[str, int]:
    """The largest per-tensor working set of a matrix-method merge, counted from the executor and SWUDI-A.

    For a merged d_out x d_in tensor with N experts stored in fp16: 2 (N + 1) fp16 inputs (this tensor
    and the one read ahead), N + 5 float32 matrices (the stack of deltas, the base, tau_init, D, the
    delta), and 4 d_in^2 float32 for C, its eigenvectors and eigh's work arrays. Averaged tensors
    (embeddings, lm_head) are processed in 64 MiB row blocks and stay below this.
    """
    from specmerge.io.formats.sources import open_source

    n = sum(1 for p in models.iterdir() if p.name.startswith("expert"))
    best = ("", 0)
    with open_source(models / "base") as base:
        for name, info in base.infos().items():
            if len(info.shape) != 2 or "embed" in name or "lm_head" in name:
                continue
            d_out, d_in = info.shape
            size = 2 * (n + 1) * d_out * d_in * 2 + (n + 5) * d_out * d_in * 4 + 4 * d_in * d_in * 4
            best = max(best, (name, size), key=lambda x: x[1])
    return best


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["generate", "measure", "_merge", "_load_all"],
                        help="generate the models, or measure (_merge and _load_all are its child jobs)")  # fmt: skip
    parser.add_argument("--models", type=Path, required=True, help="folder of base/ and expert0/ .. expert<N-1>/")
    parser.add_argument("--experts", type=int, default=4, help="experts to generate (default 4)")
    parser.add_argument("--method", default="swudi_a", help="merge method measured (default swudi_a)")
    parser.add_argument("--out", type=Path, default=None, help="merge output (default MODELS/merged, replaced)")
    parser.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16",
                        help="generate: the checkpoints' dtype (default float16)")  # fmt: skip
    args = parser.parse_args()
    if args.experts < 0:
        parser.error(f"--experts must be 0 or more, got {args.experts}")
    if args.command == "generate":
        generate(args.models, args.experts, args.dtype)
        return
    model_family(parser, args.models, "expert", generate="python bench/memory.py generate --models DIR")
    if args.command == "_merge":
        print(json.dumps(measure_merge(args.models, args.out, args.method)))
    elif args.command == "_load_all":
        print(json.dumps(measure_load_all(args.models)))
    else:
        from specmerge.methods import get_method

        try:
            get_method(args.method)
        except ValueError as err:  # an unknown name, with a did-you-mean hint
            parser.error(f"--method: {err}")
        out = args.out or args.models / "merged"
        rows = []
        for job in (["_merge", "--out", str(out), "--method", args.method], ["_load_all"]):
            done = subprocess.run(
                [sys.executable, __file__, job[0], "--models", str(args.models), *job[1:]],
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
                fail(parser.prog, f"the {job[0][1:]} job failed: {lines[-1]}")
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        ckpt = checkpoint_bytes(args.models / "base")
        name, work = workspace_bytes(args.models)
        gib = 2**30
        print(f"checkpoint: {ckpt / gib:.2f} GiB; largest 2-D tensor {name}; workspace estimate {work / gib:.2f} GiB")
        print(f"bound: 0.3 x checkpoint + workspace = {(0.3 * ckpt + work) / gib:.2f} GiB\n")
        columns = ["seconds", "peak anon above baseline", "peak RSS above baseline", "peak file-backed", "VmHWM"]
        print("| job | " + " | ".join(columns) + " |  (memory in GiB)")
        print("|---|" + "---:|" * len(columns))
        keys = ["peak_anon_above_baseline_gib", "peak_rss_above_baseline_gib", "peak_file_backed_gib", "vm_hwm_gib"]
        for r in rows:
            print(f"| {r['job']} | {r['seconds']:.0f} | " + " | ".join(f"{r[k]:.2f}" for k in keys) + " |")


if __name__ == "__main__":
    main()
