"""What `--quantize fp8-block` costs a merged model in accuracy: the accuracy benchmark's experts merged by the CLI,
written dense and in fp8, scored on the same sentences.

    python bench/quantized_output_accuracy.py --cache DIR [--seeds 0] [--method swudi_a] [--precision float32] \
        [--out FILE]

Reads the cached experts of ``specmerge-bench accuracy --cache DIR`` (8 tasks, full fine-tuning; never trains).
Per seed: the CLI merges the seed's eight expert folders onto the base (``specmerge merge BASE E1 .. E8 -m METHOD
-p scale=s --dtype float32 --override 'pooler.*=keep_base'``: the experts are saved without the pooler, which
mean-pooled features never use) at every final scale of the benchmark's grid, and the scale is chosen on val from these
dense merges, as the benchmark chooses it. At that scale the CLI merges again with ``--quantize fp8-block``. Its
folder is loaded by transformers (which dequantizes FP8 weights on a CPU) and by specmerge's own reader; the two
must give the same weights. Each model is scored on val and test with the benchmark's probe heads:

- ``dense``: the merge written in float32;
- ``fp8 weights``: the fp8-block output, weights dequantized (codes x block scale), float32 compute -- how
  transformers runs it on a CPU;
- ``fp8 weights + activations (emulated)``: the same, and the input of every fp8 linear layer quantized as the
  block-FP8 GPU kernels quantize it (per token and group of 128 columns, scale = amax / 448, float8_e4m3fn), with
  float32 products -- an emulation of W8A8 inference, not a GPU kernel.

Per task: accuracy and the paired counts against dense (b: sentences only dense gets right, c: only the fp8 model),
with McNemar's exact p-value. The record (all scores, the chosen scale, the largest quantization errors of
report.json, commands, versions) goes to ``--out`` (default ``bench/results/quantized_output/<key>-<method>.json``).

    python bench/quantized_output_accuracy.py --show RECORD

prints the tables of a record (BENCHMARKS.md quotes them): per seed, each model's average val and test accuracy
and the paired counts on test summed over the tasks, with McNemar's exact p-value on those sums; then test accuracy
per task.
"""

from __future__ import annotations

import copy
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specmerge_bench.inputs import Parser, cached_setting, fail

SCALES = (0.1, 0.2, 0.3, 0.5, 1.0)  # the accuracy benchmark's final-scale grid
GROUP = 128  # the activation group of the block-FP8 kernels (the weights' block is 128 x 128)
OUT_DIR = Path(__file__).resolve().parent / "results" / "quantized_output"


def merge(base: Path, experts: list[Path], out: Path, method: str, scale: float, quantize: str) -> list[str]:
    """Run the CLI; return its command line (program name first)."""
    args = ["merge", str(base), *map(str, experts), "-o", str(out), "-m", method, "-p", f"scale={scale}",
            "--dtype", "float32", "--quantize", quantize, "--override", "pooler.*=keep_base", "-q"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "specmerge", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"specmerge {' '.join(args)} failed: {done.stderr.strip()[-2000:]}")
    return ["specmerge", *args]


def fp8_activations(model, names: set[str]) -> list:
    """Quantize the input of each linear layer in ``names`` per token and 128-column group to float8_e4m3fn
    (scale amax / 448), as block-FP8 kernels do; returns the hook handles."""
    import torch

    top = torch.finfo(torch.float8_e4m3fn).max

    def quantize(_module, inputs):
        (x,) = inputs
        width = x.shape[-1]
        pad = (-width) % GROUP
        grouped = torch.nn.functional.pad(x, (0, pad)).unflatten(-1, (-1, GROUP))
        scale = grouped.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / top
        codes = (grouped / scale).to(torch.float8_e4m3fn)
        return ((codes.to(x.dtype) * scale).flatten(-2)[..., :width],)

    modules = dict(model.named_modules())
    return [modules[name].register_forward_pre_hook(quantize) for name in sorted(names)]


def mcnemar(b: int, c: int) -> float:
    """McNemar's exact two-sided p-value for ``b`` and ``c`` discordant pairs (1 when there are none)."""
    from scipy.stats import binomtest

    return binomtest(b, b + c, 0.5).pvalue if b + c else 1.0


def paired(dense, other) -> dict[str, float | int]:
    b, c = int((dense & ~other).sum()), int((other & ~dense).sum())
    return {"b_dense_only": b, "c_other_only": c, "p_mcnemar": mcnemar(b, c)}


def show(record: dict) -> str:
    """The record's tables as Markdown (see the module's docstring)."""
    lines = []
    for seed, run in record["seeds"].items():
        scores, pairs = run["scores"], run["paired"]["test"]
        lines += [f"{record['method']}, seed {seed}, s = {run['chosen_scale']} (chosen on val from the dense merges); "
                  f"{run['quantized_tensors']} weights in fp8, relative error median {run['median_error']:.2e}, "
                  f"largest {max(run['largest_errors'].values()):.2e}:", "",
                  "| model | val acc (%) | test acc (%) | only dense right | only this right | p (McNemar) |",
                  "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for label in scores["test"]:
            val, test = 100 * scores["val"][label]["mean"], 100 * scores["test"][label]["mean"]
            if label == "dense":
                lines.append(f"| {label} | {val:.2f} | {test:.2f} | | | |")
                continue
            b = sum(p["b_dense_only"] for p in pairs[label].values())
            c = sum(p["c_other_only"] for p in pairs[label].values())
            lines.append(f"| {label} | {val:.2f} | {test:.2f} | {b} | {c} | {mcnemar(b, c):.2g} |")
        tasks = [t for t in scores["test"]["dense"] if t != "mean"]
        lines += ["", f"Test accuracy per task (%), seed {seed}:", "", "| model | " + " | ".join(tasks) + " |",
                  "|---" + "|---:" * len(tasks) + "|"]  # fmt: skip
        for label, figures in scores["test"].items():
            lines.append(f"| {label} | " + " | ".join(f"{100 * figures[t]:.2f}" for t in tasks) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    if sys.argv[1:2] == ["--show"]:
        parser = Parser(prog="quantized_output_accuracy.py", description="print a record's tables")
        parser.add_argument("--show", type=Path, required=True, metavar="RECORD")
        path = parser.parse_args().show
        try:
            print(show(json.loads(path.read_text())))
        except (OSError, ValueError, KeyError, TypeError) as err:
            fail(parser.prog, f"{path} is not a record of this script ({err!r})")
        return
    import safetensors.torch
    import torch
    import transformers

    from specmerge.io.formats.sources import open_source
    from specmerge_bench.accuracy import precision
    from specmerge_bench.accuracy.base_model import load_base_model_path
    from specmerge_bench.accuracy.cache_files import load_scoring
    from specmerge_bench.accuracy.model import correct, load_state

    parser = Parser(prog="quantized_output_accuracy.py", description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, required=True, help="the cache folder of specmerge-bench accuracy")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="training seeds (default 0)")
    parser.add_argument("--method", default="swudi_a", help="merge method (default swudi_a, at its defaults)")
    parser.add_argument("--precision", choices=precision.PRECISIONS, default="float32",
                        help="scoring forward passes, as the benchmark's (default float32)")  # fmt: skip
    parser.add_argument("--out", type=Path, help=f"the record (default {OUT_DIR}/<experts key>-<method>.json)")
    args = parser.parse_args()
    args.track = "full"
    built = cached_setting(parser, args, 8)
    base_model, _, tasks_encoded, heads = load_scoring(built)
    base_dir = load_base_model_path()
    tasks = list(built["tasks"])

    def score(model, split: str) -> dict[str, torch.Tensor]:
        return {task: correct(model, tasks_encoded[task][split], heads[task]) for task in tasks}

    def summary(right: dict[str, torch.Tensor]) -> dict[str, float]:
        acc = {task: float(r.double().mean()) for task, r in right.items()}
        return {"mean": sum(acc.values()) / len(acc), **acc}

    record = {"experts_key": built["experts_key"], "method": args.method, "scales": list(SCALES),
              "precision": precision.tag(), "torch": torch.__version__, "transformers": transformers.__version__,
              "machine": platform.machine(), "date": time.strftime("%Y-%m-%d"), "seeds": {}}  # fmt: skip
    scratch = copy.deepcopy(base_model)
    with tempfile.TemporaryDirectory(prefix="quantized-output-") as tmp:
        for seed in args.seeds:
            folders = built["paths"]["experts"][seed]
            experts = [Path(folders[task]) for task in tasks]
            val, val_right, commands, seconds = {}, {}, {}, {}
            for scale in SCALES:
                out = Path(tmp) / f"seed{seed}-dense-{scale}"
                start = time.perf_counter()
                commands[f"dense {scale}"] = merge(base_dir, experts, out, args.method, scale, "none")
                seconds[f"dense {scale}"] = time.perf_counter() - start
                load_state(scratch, safetensors.torch.load_file(out / "model.safetensors"))
                val_right[scale] = score(scratch, "val")
                val[scale] = summary(val_right[scale])
                print(f"seed {seed}: {args.method} s={scale}: val {100 * val[scale]['mean']:.2f} %", flush=True)
            chosen = max(SCALES, key=lambda s: (val[s]["mean"], -s))  # ties: the smaller scale
            dense_dir, fp8_dir = Path(tmp) / f"seed{seed}-dense-{chosen}", Path(tmp) / f"seed{seed}-fp8"
            start = time.perf_counter()
            commands["fp8-block"] = merge(base_dir, experts, fp8_dir, args.method, chosen, "fp8-block")
            seconds["fp8-block"] = time.perf_counter() - start
            report = json.loads((fp8_dir / "report.json").read_text())
            errors = report.get("quantization", {}).get("relative_error", {})
            if not errors:
                fail(parser.prog, f"{fp8_dir}/report.json names no quantized tensor")

            loaded = transformers.BertModel.from_pretrained(fp8_dir, dtype=torch.float32)
            source = open_source(fp8_dir)
            try:
                ours = {name: source.load(name) for name in source.infos()}
            finally:
                source.close()
            state = loaded.state_dict()  # (no non-persistent buffers such as embeddings.position_ids)
            compared = [n for n in ours if n in state]
            if not set(errors) <= set(compared):
                fail(parser.prog, f"transformers did not load every fp8 weight of {fp8_dir}")
            mismatch = max(float((state[n] - ours[n]).abs().max()) for n in compared)
            if mismatch != 0.0:
                fail(parser.prog, f"transformers and specmerge dequantize {fp8_dir} differently (max {mismatch:g})")
            load_state(scratch, safetensors.torch.load_file(dense_dir / "model.safetensors"))
            right = {"val": {"dense": val_right[chosen]}, "test": {"dense": score(scratch, "test")}}
            for split in right:
                right[split]["fp8 weights"] = score(loaded, split)
            quantized = {name.removesuffix(".weight") for name in errors}
            hooks = fp8_activations(loaded, quantized)
            try:
                for split in right:
                    right[split]["fp8 weights + activations (emulated)"] = score(loaded, split)
            finally:
                for hook in hooks:
                    hook.remove()
            scores = {split: {label: summary(r) for label, r in by.items()} for split, by in right.items()}
            pairs = {
                split: {label: {task: paired(by["dense"][task], r[task]) for task in tasks}
                        for label, r in by.items() if label != "dense"}
                for split, by in right.items()
            }  # fmt: skip
            worst = sorted(errors.items(), key=lambda kv: -kv[1])
            record["seeds"][str(seed)] = {
                "val_by_scale": {str(s): v for s, v in val.items()}, "chosen_scale": chosen, "scores": scores,
                "paired": pairs, "quantized_tensors": len(errors), "largest_errors": dict(worst[:5]),
                "median_error": worst[len(worst) // 2][1], "commands": commands, "seconds": seconds,
            }  # fmt: skip
            for split in ("val", "test"):
                line = ", ".join(f"{label} {100 * s['mean']:.2f} %" for label, s in scores[split].items())
                print(f"seed {seed}, s={chosen}, {split}: {line}", flush=True)
    out = args.out or OUT_DIR / f"{built['experts_key']}-{args.method}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"record: {out}\n\n{show(record)}")


if __name__ == "__main__":
    main()
