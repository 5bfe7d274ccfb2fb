"""The merge methods that mergekit also has, run by both tools with the same settings, compared tensor by tensor.

    python bench/mergekit_methods.py --models /tmp/demo --mergekit /work/mergekit-venv/bin/mergekit-yaml
    python bench/mergekit_methods.py --models /work/benchdata/llama1b --mergekit /work/mergekit-venv/bin/mergekit-yaml \
        --cases linear,slerp,model_stock,ties,della_d1,della

Inputs: ``MODELS/base`` and ``MODELS/expert*`` (``specmerge demo --workdir MODELS`` or ``bench/memory.py generate``).
Per case the specmerge recipe and the mergekit YAML are written with the same settings (expert weights 0.6, 0.4,
0.3, 0.2, ... where the method takes them; every tensor merged by the method, embeddings included, as mergekit
does), then ``specmerge run`` and ``mergekit-yaml`` run one after the other, each in its own process with
OMP_NUM_THREADS = MKL_NUM_THREADS = 2 (specmerge ``--no-fsync``, as mergekit does not sync; mergekit
``--lazy-unpickle --out-shard-size 100B``, CPU; both compute in float32 and write the base's dtype). Every output
tensor is compared: max |ours - theirs|, that over the tensor's max |theirs| (the relative difference), and the
entries beyond the rounding tolerance (eps of the output dtype + 8 eps of float32, times the tensor's max
|theirs|: one rounding of the output and a few of the float32 sums). DARE / DELLA are random in both tools, so
for them the table gives instead the mean over tensors of ||M - U||_F / ||U - W_0||_F, M the pruned merge and U
the same tool's unpruned merge (the ``*_d1`` case, density 1), for each tool.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from specmerge_bench.inputs import Parser, fail, model_family

WEIGHTS = [0.6, 0.4, 0.3, 0.2, 0.1, 0.05]
THREADS = "2"


@dataclass(frozen=True)
class Case:
    """One comparison: the method, our settings and mergekit's, and (random methods) the unpruned case to measure to."""

    name: str
    method: str  # the same name in both tools
    params: dict = field(default_factory=dict)  # ours
    shared: dict = field(default_factory=dict)  # mergekit's top-level parameters
    per_model: dict = field(default_factory=dict)  # mergekit's parameters of every expert (weight added)
    weighted: bool = True
    overrides: tuple = ()  # ours: (pattern, params)
    slerp: bool = False  # base + the first expert only
    reference: str = ""  # random: the unpruned case of the same tool
    note: str = ""


LAYERS = [0.2, 0.5, 0.9]
ATTN = [0.9, 0.1]
D1 = {"density": 1.0, "epsilon": 0.0}
MAGPRUNE = {"density": 0.5, "epsilon": 0.15}
# fmt: off
CASES = [
    Case("linear", "linear", {"normalize": True}, note="weighted mean"),
    Case("task_arithmetic", "task_arithmetic", {"scale": 0.5}, {"lambda": 0.5}),
    Case("ties", "ties", {"density": 0.5, "scale": 1.0}, per_model={"density": 0.5}),
    Case("ties_layers", "ties", {"density": [0.3, 0.7], "scale": 1.0}, per_model={"density": [0.3, 0.7]}),
    Case("breadcrumbs", "breadcrumbs", {"density": 0.9, "beta": 0.01, "scale": 1.0},
         per_model={"density": 0.9, "gamma": 0.01}),
    Case("model_stock", "model_stock", weighted=False),
    Case("slerp", "slerp", {"t": 0.3}, {"t": 0.3}, weighted=False, slerp=True),
    Case("slerp_layers", "slerp", {"t": LAYERS}, {"t": [{"filter": "self_attn", "value": ATTN}, {"value": LAYERS}]},
         weighted=False, slerp=True, overrides=(("*self_attn*", {"t": ATTN}),)),
    Case("dare_linear_d1", "dare_linear", {"drop_rate": 0.0}, per_model={"density": 1.0}),
    Case("dare_ties_d1", "dare_ties", {"drop_rate": 0.0}, {"normalize": True}, {"density": 1.0},
         note="mergekit normalize: true (its default false sums)"),
    Case("della_d1", "della", D1, per_model=D1),
    Case("della_linear_d1", "della_linear", D1, per_model=D1),
    Case("dare_linear", "dare_linear", {"drop_rate": 0.5}, per_model={"density": 0.5}, reference="dare_linear_d1"),
    Case("dare_ties", "dare_ties", {"drop_rate": 0.5}, {"normalize": True}, {"density": 0.5},
         reference="dare_ties_d1", note="mergekit normalize: true"),
    Case("della", "della", MAGPRUNE, per_model=MAGPRUNE, reference="della_d1"),
    Case("della_linear", "della_linear", MAGPRUNE, per_model=MAGPRUNE, reference="della_linear_d1"),
]
# fmt: on


def recipe(case: Case, base: Path, experts: list[Path]) -> dict:
    """The specmerge recipe of a case: every tensor merged by the method (embeddings too), float32 arithmetic."""
    out = {"base": str(base), "experts": [str(e) for e in experts], "method": case.method, "params": case.params,
           "merge_embeddings": True, "compute_dtype": "float32", "shard_size": "100GB"}  # fmt: skip
    if case.weighted:
        out["expert_weights"] = WEIGHTS[: len(experts)]
    if case.overrides:
        out["overrides"] = [{"pattern": p, "params": params} for p, params in case.overrides]
    return out


def mergekit_config(case: Case, base: Path, experts: list[Path], out_dtype: str) -> dict:
    """mergekit's YAML of a case (as JSON, which YAML reads): float32 arithmetic, the base's dtype written."""
    models = []
    for i, expert in enumerate(experts):
        params = dict(case.per_model)
        if case.weighted:
            params["weight"] = WEIGHTS[i]
        models.append({"model": str(expert), **({"parameters": params} if params else {})})
    config = {"merge_method": case.method, "dtype": "float32", "out_dtype": out_dtype}
    if case.slerp:
        models = [{"model": str(base)}, *models]
    if case.method != "linear":
        config["base_model"] = str(base)
    config["models"] = models
    if case.shared:
        config["parameters"] = case.shared
    return config


def run(command: list[str], what: str) -> float:
    """Wall seconds of one process (threads pinned), after an untimed ``sync``; one-line error if it fails."""
    subprocess.run(["sync"], check=False)
    env = {**os.environ, "OMP_NUM_THREADS": THREADS, "MKL_NUM_THREADS": THREADS}
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        lines = (done.stderr.strip() or done.stdout.strip()).splitlines() or [f"exit status {done.returncode}"]
        fail("mergekit_methods.py", f"{what} failed ({done.returncode}): {lines[-1]}")
    return seconds


def tensor_files(folder: Path) -> dict[str, Path]:
    from safetensors import safe_open

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            out.update(dict.fromkeys(f.keys(), file))
    return out


def load(files: dict[str, Path], name: str):
    from safetensors import safe_open

    with safe_open(files[name], "pt") as f:
        return f.get_tensor(name).double()


def compare(ours: Path, theirs: Path) -> dict:
    """Max |difference|, max relative difference (to the tensor's max |theirs|) and entries beyond tolerance."""
    import torch

    left, right = tensor_files(ours), tensor_files(theirs)
    if set(left) != set(right):
        fail("mergekit_methods.py", f"{ours} and {theirs} hold different tensors: {sorted(set(left) ^ set(right))[:4]}")
    worst, worst_rel, beyond, total, where = 0.0, 0.0, 0, 0, ""
    for name in sorted(left):
        from safetensors import safe_open

        with safe_open(right[name], "pt") as f:
            dtype = f.get_slice(name).get_dtype()
        eps = {"F16": torch.finfo(torch.float16).eps, "BF16": torch.finfo(torch.bfloat16).eps}.get(dtype, 0.0)
        a, b = load(left, name), load(right, name)
        diff = (a - b).abs()
        scale = float(b.abs().max()) or 1.0
        tol = (eps + 8 * torch.finfo(torch.float32).eps) * scale
        beyond += int((diff > tol).sum())
        total += diff.numel()
        if float(diff.max()) > worst:
            worst, where = float(diff.max()), name
        worst_rel = max(worst_rel, float(diff.max()) / scale)
    return {"max_abs": worst, "max_rel": worst_rel, "beyond": beyond, "entries": total, "worst_tensor": where}


def distance_to(merged: Path, unpruned: Path, base: Path) -> float:
    """Mean over tensors of ||M - U||_F / ||U - W_0||_F (tensors where U = W_0 left out)."""
    m, u, w0 = tensor_files(merged), tensor_files(unpruned), tensor_files(base)
    ratios = []
    for name in sorted(m):
        delta = load(u, name) - load(w0, name)
        norm = float(delta.norm())
        if norm > 0:
            ratios.append(float((load(m, name) - load(u, name)).norm()) / norm)
    return sum(ratios) / len(ratios)


def base_dtype(base: Path) -> str:
    from safetensors import safe_open

    files = tensor_files(base)
    name = next(iter(sorted(files)))
    with safe_open(files[name], "pt") as f:
        return {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}[f.get_slice(name).get_dtype()]


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, required=True, help="folder of base/ and expert*/")
    parser.add_argument("--mergekit", type=Path, required=True, help="mergekit-yaml executable")
    parser.add_argument("--work", type=Path, default=None, help="recipes and outputs (default MODELS/../mk-methods)")
    parser.add_argument("--cases", default="", help=f"comma list of cases (default all: {[c.name for c in CASES]})")
    parser.add_argument("--keep", action="store_true", help="keep the merged outputs")
    args = parser.parse_args()
    generate = "specmerge demo --workdir DIR` or `python bench/memory.py generate --models DIR"
    base, experts = model_family(parser, args.models, "expert", generate=generate)
    if not args.mergekit.is_file():
        parser.error(f"--mergekit {args.mergekit} is not a file (pip install mergekit in its own venv)")
    by_name = {c.name: c for c in CASES}
    names = [n.strip() for n in args.cases.split(",") if n.strip()] or list(by_name)
    unknown = [n for n in names if n not in by_name]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; known: {list(by_name)}")
    cases = [by_name[n] for n in names]
    missing = [c.reference for c in cases if c.reference and c.reference not in names]
    if missing:
        parser.error(f"--cases: the random cases need their unpruned cases too: add {missing}")
    work = args.work or args.models.parent / f"{args.models.name}-mk-methods"
    work.mkdir(parents=True, exist_ok=True)
    out_dtype = base_dtype(base)
    for folder in [base, *experts]:  # warm page cache: no job pays the first read
        for file in folder.glob("*.safetensors"):
            with open(file, "rb") as f:
                while f.read(1 << 24):
                    pass
    specmerge = [sys.executable, "-m", "specmerge", "run"]
    rows = []
    for case in cases:
        inputs = experts[:1] if case.slerp else experts
        (work / f"{case.name}.recipe.yaml").write_text(json.dumps(recipe(case, base, inputs), indent=1))
        (work / f"{case.name}.mergekit.yaml").write_text(json.dumps(mergekit_config(case, base, inputs, out_dtype)))
        ours, theirs = work / f"ours-{case.name}", work / f"mk-{case.name}"
        shutil.rmtree(theirs, ignore_errors=True)
        t_ours = run([*specmerge, str(work / f"{case.name}.recipe.yaml"), "-o", str(ours), "--overwrite", "-q",
                      "--no-fsync"], f"specmerge {case.name}")  # fmt: skip
        mergekit = [str(args.mergekit), str(work / f"{case.name}.mergekit.yaml"), str(theirs), "--lazy-unpickle",
                    "--out-shard-size", "100B", "--no-cuda", "--no-copy-tokenizer"]  # fmt: skip
        t_theirs = run(mergekit, f"mergekit {case.name}")
        row = {"case": case.name, "ours_s": t_ours, "theirs_s": t_theirs, "note": case.note, **compare(ours, theirs)}
        if case.reference:
            row["dist_ours"] = distance_to(ours, work / f"ours-{case.reference}", base)
            row["dist_theirs"] = distance_to(theirs, work / f"mk-{case.reference}", base)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    if not args.keep:
        for case in cases:
            for prefix in ("ours-", "mk-"):
                shutil.rmtree(work / f"{prefix}{case.name}", ignore_errors=True)
    weights = WEIGHTS[: len(experts)]
    print(f"\n{len(experts)} experts, output {out_dtype}; weights {weights} where the method takes them\n")
    print("| case | specmerge s | mergekit s | max abs diff | max rel diff | entries beyond tol | verdict |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in rows:
        if "dist_ours" in r:
            verdict = f"random: to unpruned {r['dist_ours']:.3f} (ours) / {r['dist_theirs']:.3f} (mergekit)"
        else:
            verdict = "agree" if r["beyond"] == 0 else f"differ ({r['beyond'] / r['entries']:.2e} of entries)"
        verdict += f"; {r['note']}" if r["note"] else ""
        print(f"| {r['case']} | {r['ours_s']:.1f} | {r['theirs_s']:.1f} | {r['max_abs']:.3g} | {r['max_rel']:.3g} | "
              f"{r['beyond']} / {r['entries']} | {verdict} |")  # fmt: skip


if __name__ == "__main__":
    main()
