"""Sizes of the accuracy benchmark's stored merges, and where the WUDI sweep's iterate lies between its ends.

    python bench/merge_distances.py --merges CACHE/merges/<experts key>/seed<k>-<code key>-<cpu>
    python bench/merge_distances.py --adapters CACHE/lora-experts/<experts key>/seed<k>

``--merges`` reads one seed's merge store (a ``<candidate key>.safetensors`` per candidate, written by ``specmerge-bench
accuracy``) and prints, in Frobenius norms over every merged tensor of the method (before the scale s):

- each stored candidate's merged delta (the WUDI snapshots included: WUDI-300 of the main table is the sweep's
  300-step snapshot, one file);
- for each WUDI snapshot of the sweep, its distance from task arithmetic (the sum of the task vectors, where WUDI
  starts) and to D C⁺ (``closed_form``, the limit WUDI's gradient descent tends to).

``--adapters`` reads one seed's LoRA experts (a PEFT adapter folder per task) and prints each expert's task vector
``scale * B @ A`` in the same norm, and the norm of their sum (task arithmetic at s = 1, which the merge store's
``task_arithmetic`` candidate holds: the two figures check each other).

Reads only these files: no model is loaded and nothing is scored. The BENCHMARKS.md norms and sweep distances of the
LoRA track come from it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from specmerge.errors import SpecmergeError
from specmerge.io.formats.peft import is_adapter, open_adapter
from specmerge_bench.accuracy.merging import Candidate
from specmerge_bench.accuracy.rows import WUDI_STEPS
from specmerge_bench.inputs import Parser

METHOD = "method/"  # the merge store's prefix of the method's own tensors (the rest are the averaged ones)


def method_deltas(parser: Parser, path: Path) -> dict[str, torch.Tensor]:
    """One stored candidate's method tensors, in float64 (a file that cannot be read is a one-line error)."""
    try:
        with safe_open(path, "pt") as f:
            return {name: f.get_tensor(name).double() for name in f.keys() if name.startswith(METHOD)}  # noqa: SIM118
    except (SafetensorError, OSError) as error:
        parser.error(f"{path}: not a readable safetensors file ({error}); delete it and rerun the benchmark's merge "
                     "stage, which writes it again")  # fmt: skip


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Frobenius norm of a - b over all tensors (an absent tensor counts as zero)."""
    zero = torch.zeros((), dtype=torch.float64)
    return sum(((a.get(k, zero) - b.get(k, zero)) ** 2).sum() for k in a.keys() | b.keys()).sqrt().item()


def task_vectors(parser: Parser, folder: Path) -> None:
    """Print each LoRA expert's task vector norm (in float64) and the norm of their sum."""
    if not folder.is_dir():
        parser.error(f"--adapters {folder} is not a folder")
    adapters = sorted(path for path in folder.iterdir() if is_adapter(path))
    if not adapters:
        parser.error(f"--adapters {folder} holds no PEFT adapter folders (give CACHE/lora-experts/<key>/seed<k>)")
    total: dict[str, torch.Tensor] = {}
    rows = []
    for path in adapters:
        try:
            with open_adapter(path) as adapter:
                deltas = {name: adapter.load(name).to("cpu", torch.float64).dense() for name in adapter.modules()}
        except SpecmergeError as error:
            parser.error(str(error))
        for name, delta in deltas.items():
            total[name] = total[name] + delta if name in total else delta
        rows.append(f"| {path.name} | {len(deltas)} | {distance(deltas, {}):.1f} |")
    print("| expert | adapted weights | norm of its task vector |\n|---|---:|---:|", *rows, sep="\n")
    print(f"| sum (task arithmetic, s = 1) | {len(total)} | {distance(total, {}):.1f} |")


def merge_store(parser: Parser, merges: Path) -> None:
    """Print the stored candidates' norms and the WUDI sweep's distances to its ends."""
    if not merges.is_dir():
        parser.error(f"--merges {merges} is not a folder")
    stored = {path.stem: path for path in sorted(merges.glob("*.safetensors"))}
    sweep = {Candidate("wudi_steps", "wudi", {"steps": s}).key: s for s in WUDI_STEPS}
    ends = {}  # the two ends' stored keys, by method
    for method in ("task_arithmetic", "closed_form"):
        keys = [key for key in stored if key.startswith(f"{method}-")]
        if len(keys) != 1:
            parser.error(f"--merges {merges} holds {len(keys)} {method}-*.safetensors, expected one (give one "
                         "seed's folder of a finished merge stage)")  # fmt: skip
        ends[method] = keys[0]
    read = {key: method_deltas(parser, stored[key]) for key in ends.values()}
    start, limit = read[ends["task_arithmetic"]], read[ends["closed_form"]]
    zero: dict[str, torch.Tensor] = {}
    norms, distances = [], []
    for key, path in stored.items():  # each file read once: its norm, and its distances if it is a WUDI snapshot
        deltas = read[key] if key in read else method_deltas(parser, path)
        norms.append(f"| {key} | {distance(deltas, zero):.1f} |")
        if key in sweep:
            distances.append((sweep[key], f"| {sweep[key]:,} | {distance(deltas, start):.1f} | "
                             f"{distance(deltas, limit):.1f} |"))  # fmt: skip
    print("| candidate | norm of its merged delta |\n|---|---:|", *norms, sep="\n")
    print("\n| WUDI steps | distance from TA (its start) | distance to D C⁺ (its limit) |\n|---:|---:|---:|")
    print(*(row for _, row in sorted(distances)), sep="\n")
    print(f"| D C⁺ | {distance(limit, start):.1f} | 0 |")


def main() -> None:
    parser = Parser(prog="merge_distances.py", description=__doc__.splitlines()[0])
    parser.add_argument("--merges", type=Path,
                        help="one seed's merge store: CACHE/merges/<experts key>/seed<k>-<code key>-<cpu>")  # fmt: skip
    parser.add_argument("--adapters", type=Path,
                        help="one seed's LoRA experts: CACHE/lora-experts/<experts key>/seed<k>")  # fmt: skip
    args = parser.parse_args()
    if args.merges is None and args.adapters is None:
        parser.error("give --merges, --adapters or both")
    if args.adapters is not None:
        task_vectors(parser, args.adapters)
    if args.merges is not None:
        merge_store(parser, args.merges)


if __name__ == "__main__":
    main()
