"""SHA-256 of every merge output, to show that a refactoring leaves every method's results bit-identical.

Three modes; run the first two on the old and the new code and compare the JSON files with the third:

    python bench/output_hashes.py demo --out new.json
        the demo's tiny Llama and four experts (built here, seeded), merged by every registered method;
        plus four LoRA adapters of it (seeded), merged into a model by every method and into an adapter
        by every method with an exact factored form. Hashes: every output file but the report, recipe
        and model card (which hold times and paths).
    python bench/output_hashes.py accuracy --cache DIR --seed 0 --out new.json
        the accuracy benchmark's MiniLM experts of one seed (``specmerge-bench accuracy --cache DIR``
        layout: DIR/experts/<key>/seed<S>/<task>/model.safetensors), every candidate of the benchmark
        merged (scale 1), hashing each candidate's deltas tensor by tensor.
    python bench/output_hashes.py compare old.json new.json
        lists every key that differs or is missing; exit 1 if any.

Compare hashes made on the same machine with the same ``--threads`` (default 1): reductions in matrix
products and decompositions are split by the thread count, and the default thread count of a merge
depends on how busy the CPUs are. To hash the code of an earlier commit: ``git worktree add /tmp/old <commit>``
and run this script with ``PYTHONPATH=/tmp/old/src``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

IGNORED = {"report.json", "recipe.yaml", "README.md"}


def _fail(message: str) -> None:
    print(f"output_hashes: {message}", file=sys.stderr)
    raise SystemExit(2)


def _folder_hashes(folder: Path) -> dict[str, str]:
    """Every file's SHA-256; an adapter config's base path (a temporary folder) is replaced by a fixed name first."""
    out = {}
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name not in IGNORED):
        data = path.read_bytes()
        if path.name == "adapter_config.json":
            config = json.loads(data)
            config["base_model_name_or_path"] = "<base>"
            data = json.dumps(config, sort_keys=True).encode()
        out[path.name] = hashlib.sha256(data).hexdigest()
    return out


def _lora_adapters(base: Path, root: Path, n: int = 4, rank: int = 4) -> list[Path]:
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(str(base / "model.safetensors"))
    targets = ("q_proj", "v_proj", "down_proj")
    layers = {n: w.shape for n, w in weights.items() if w.dim() == 2 and n.rsplit(".", 2)[-2] in targets}
    folders = []
    for k in range(n):
        g = torch.Generator().manual_seed(1000 + k)
        tensors = {}
        for name, (d_out, d_in) in sorted(layers.items()):
            module = f"base_model.model.{name.removesuffix('.weight')}"
            tensors[f"{module}.lora_A.weight"] = torch.randn(rank, d_in, generator=g) / d_in**0.5
            tensors[f"{module}.lora_B.weight"] = 0.02 * torch.randn(d_out, rank, generator=g)
        folder = root / f"lora{k}"
        folder.mkdir()
        save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": list(targets)}
        (folder / "adapter_config.json").write_text(json.dumps(config))
        folders.append(folder)
    return folders


def demo_hashes(threads: int) -> dict[str, str]:
    import specmerge
    from specmerge.demo import build_experts

    out: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base, experts, _ = build_experts(root / "models")
        adapters = _lora_adapters(base, root / "models")
        (root / "out").mkdir()
        for name, method in sorted(getattr(specmerge, "all_methods", getattr(specmerge, "methods", None))().items()):
            runs = {"full": (experts, "model"), "lora": (adapters, "model")}
            if method.factored:
                runs["lora->lora"] = (adapters, "lora")
            for label, (inputs, output_format) in runs.items():
                if getattr(method, "needs_base", False):  # slerp: the base and one expert
                    inputs = inputs[:1]
                target = root / "out" / f"{name}-{label.replace('->', '-')}"
                specmerge.merge(
                    base, inputs, target, method=name, output_format=output_format, progress=False, threads=threads
                )
                for file, digest in _folder_hashes(target).items():
                    out[f"{name}/{label}/{file}"] = digest
                print(f"{name} {label}: {len(list(target.iterdir()))} files", flush=True)
    return out


def _accuracy_modules():
    try:
        from specmerge_bench.accuracy import bench, merging
    except ImportError:
        from specmerge.accuracy import bench, merging
    return bench, merging


def accuracy_hashes(cache: Path, seed: int) -> dict[str, str]:
    import torch
    from safetensors.torch import load_file

    bench, merging = _accuracy_modules()
    folders = sorted((cache / "experts").glob(f"*/seed{seed}"))
    if not folders:
        _fail(f"no experts of seed {seed} under {cache / 'experts'} (expected experts/<key>/seed{seed}/<task>/)")
    tasks = sorted(p for p in folders[0].iterdir() if (p / "model.safetensors").is_file())
    base_file = next(iter(sorted(cache.glob("experts/*/base/model.safetensors"))), None)
    if base_file is not None:
        base = load_file(str(base_file))
    else:
        try:
            from specmerge_bench.accuracy import model
        except ImportError:
            from specmerge.accuracy import model
        base = {k: v.detach().clone() for k, v in model.load_base()[0].state_dict().items()}
    experts = []
    for task in tasks:
        state = load_file(str(task / "model.safetensors"))
        experts.append({name: state[name] for name in base})
    rows = bench.method_rows() + bench.step_rows()
    candidates = {c.key: c for row in rows for c in row.candidates}
    plain = [c for c in candidates.values() if c.method != "wudi"]
    steps = sorted({c.params["steps"] for c in candidates.values() if c.method == "wudi"})
    deltas = merging.merge_candidates(base, experts, plain, wudi_steps=steps)
    out = {}
    for key, tensors in [*deltas.method.items(), *(("avg:" + k, v) for k, v in deltas.averaged.items())]:
        digest = hashlib.sha256()
        for name in sorted(tensors):
            digest.update(name.encode())
            digest.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
        out[key] = digest.hexdigest()
    return out


def compare(old: Path, new: Path) -> int:
    a, b = json.loads(old.read_text()), json.loads(new.read_text())
    bad = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    for key in bad:
        state = "missing in new" if key not in b else "new" if key not in a else "differs"
        print(f"{state}: {key}")
    same = len([k for k in a if a[k] == b.get(k)])
    print(f"{same} identical, {len(bad)} not ({old} vs {new})")
    return 1 if any(k in a for k in bad) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    demo = sub.add_parser("demo", help="hash every method's outputs on the demo models and LoRA adapters")
    demo.add_argument("--out", type=Path, required=True, help="JSON file to write")
    demo.add_argument("--threads", type=int, default=1, help="torch threads of every merge (default 1)")

    acc = sub.add_parser("accuracy", help="hash every accuracy-benchmark candidate's deltas on one seed's experts")
    acc.add_argument("--cache", type=Path, required=True, help="the accuracy benchmark's cache folder")
    acc.add_argument("--seed", type=int, default=0, help="training seed of the experts (default 0)")
    acc.add_argument("--out", type=Path, required=True, help="JSON file to write")
    acc.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    cmp = sub.add_parser("compare", help="compare two hash files (new keys are listed but do not fail)")
    cmp.add_argument("old", type=Path)
    cmp.add_argument("new", type=Path)
    args = parser.parse_args(argv)
    if args.mode == "compare":
        for path in (args.old, args.new):
            if not path.is_file():
                _fail(f"{path} is not a file: give two JSON files written by the demo or accuracy mode")
        return compare(args.old, args.new)
    if args.mode == "accuracy" and not args.cache.is_dir():
        _fail(f"cache folder {args.cache} does not exist: run the accuracy benchmark with --cache first")
    import torch

    if args.threads < 1:
        _fail(f"--threads must be at least 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    hashes = demo_hashes(args.threads) if args.mode == "demo" else accuracy_hashes(args.cache, args.seed)
    args.out.write_text(json.dumps(hashes, indent=1, sort_keys=True))
    print(f"{len(hashes)} hashes written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
