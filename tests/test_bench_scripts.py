"""The benchmark scripts in bench/ and `specmerge-bench`: a missing or wrong input is one line, never a traceback."""

import json
import math
import runpy
import shutil
import sys
from pathlib import Path

import pytest
import torch

from specmerge.io.formats.sources import open_source
from specmerge_bench.cli import main as bench_main
from tiny_models import build_family

BENCH = Path(__file__).resolve().parents[1] / "bench"


def run_script(name: str, *args: str) -> None:
    """Run ``bench/<name>`` as ``python bench/<name> ARGS`` does, in this process."""
    argv = sys.argv
    sys.argv = [str(BENCH / name), *args]
    try:
        runpy.run_path(str(BENCH / name), run_name="__main__")
    finally:
        sys.argv = argv


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """MODELS/base and MODELS/expert0..1: a tiny Llama family, single-file checkpoints (no shard index)."""
    root = tmp_path_factory.mktemp("models")
    base, experts = build_family(root / "made", "llama", n_experts=2)
    (root / "base").symlink_to(base)
    for i, expert in enumerate(experts):
        (root / f"expert{i}").symlink_to(expert)
    return root


def cases(tmp: Path, family: Path) -> list[tuple[list[str], str]]:
    (tmp / "a-file").write_text("not a folder")
    (tmp / "empty").mkdir()
    return [
        (
            ["memory.py", "measure", "--models", str(tmp / "none")],
            "is not a folder; it must hold base/ and the experts",
        ),
        (["memory.py", "measure", "--models", str(tmp / "empty")], "is not a folder"),
        (["memory.py", "measure", "--models", str(family), "--method", "nope"], "unknown method 'nope'"),
        (["ablation.py", "--models", str(family)], "lacks expert2/, expert3/ (expected base/, expert0/"),
        (["end_to_end.py", "--models", str(family)], "lacks expert2/, expert3/"),
        (["mergekit_speed.py", "--models", str(family), "--mergekit", str(tmp / "a-file")], "lacks expert2/"),
        (["lora_model.py", "measure", "--models", str(family)], "holds no lora*/ folders"),
        (["lora_model.py", "generate", "--models", str(tmp / "empty")], "base model"),
        (["under_load.py", "--models", str(tmp / "a-file")], "is a file; give a folder"),
        (["under_load.py", "--models", str(tmp / "new"), "--methods", "nope"], "--methods: unknown nope"),
        (["accuracy_investigate.py", "--cache", str(tmp / "empty")], "holds no full experts of seed 0"),
        (["accuracy_investigate.py", "--cache", str(tmp / "empty"), "--scales", "0"], "--scales must be positive"),
        (["lora_equivalence.py", "--cache", str(tmp / "empty")], "holds no LoRA experts of seed 0"),
        (["lora_equivalence.py", "--cache", str(tmp / "none")], "is not a folder"),
        (["expert_margins.py", "--cache", str(tmp / "none")], "is not a folder"),
        (["val_test_shift.py", "--cache", str(tmp / "empty")], "holds no full experts of seed 2"),
        (["val_test_shift.py", "--cache", str(tmp / "empty"), "--draws", "0"], "--draws must be at least 1"),
        (["expert_margins.py", "--cache", str(tmp / "empty"), "--track", "lora"], "holds no lora experts of seed 0"),
        (["grid_edges.py", "--cache", str(tmp / "none")], "is not a folder"),
        (["grid_edges.py", "--cache", str(tmp / "empty")], "holds no lora experts of seed 0"),
        (["accuracy_keep.py", "--cache", str(tmp / "none"), "--out", str(tmp / "kept")], "is not a folder"),
        (["merge_distances.py", "--merges", str(tmp / "none")], "is not a folder"),
        (["merge_distances.py"], "give --merges, --adapters or both"),
        (["merge_distances.py", "--adapters", str(tmp / "empty")], "holds no PEFT adapter folders"),
        (["merge_distances.py", "--merges", str(tmp / "empty")], "holds 0 task_arithmetic-*.safetensors, expected one"),
        (["lora_speed.py", "--methods", "ties"], "invalid choice: 'ties'"),
        (["ray_executor.py", "--models", str(tmp / "empty"), "--work", str(tmp / "w")], "is not a folder"),
        (["compute_floor.py", "--repeats", "0"], "--repeats must be at least 1"),
        (["quantized_inputs.py", "measure", "--models", str(tmp / "none")], "is not a folder"),
        (["quantized_output_accuracy.py", "--cache", str(tmp / "empty")], "holds no full experts of seed 0"),
        (["quantized_output_accuracy.py", "--show", str(tmp / "a-file")], "is not a record of this script"),
        (["quantized_inputs.py", "quantize", "--models", str(family)], "quantize needs --scheme"),
        (
            ["quantized_inputs.py", "measure", "--models", str(family), "--schemes", "fp8-block"],
            f"{family.parent / (family.name + '-fp8-block')} is missing: run quantize --scheme fp8-block first",
        ),
        (["compute_floor.py", "--models", str(family), "--before-src", str(tmp)], "holds no specmerge/ package"),
        (["compute_floor.py", "--before-src", str(Path(__file__).parents[1] / "src")], "--before-src needs --models"),
        (
            ["compute_floor.py", "--device", "cuda", "--models", str(family)],
            "--models merges on the CPU" if torch.cuda.is_available() else "torch sees no CUDA device here",
        ),
    ]


def test_bench_scripts_refuse_bad_inputs_in_one_line(tmp_path, family, capsys):
    for argv, message in cases(tmp_path, family):
        with pytest.raises(SystemExit) as exit_:
            run_script(*argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2, argv
        assert err.startswith(f"{argv[0]}: error: ") and message in err, (argv, err)
        assert len(err.splitlines()) == 1, (argv, err)


def test_quantized_inputs_writes_an_fp8_set_that_reads_as_the_dense_one(tmp_path, family):
    """bench/quantized_inputs.py quantize: the copy's projections dequantize to within fp8's rounding of the dense
    weights (e4m3 keeps 3 mantissa bits: a relative error of at most 2**-4 per entry), the rest equal."""
    models = tmp_path / "set"
    shutil.copytree(family, models, symlinks=False)
    run_script("quantized_inputs.py", "quantize", "--models", str(models), "--scheme", "fp8-block")
    with open_source(models / "expert0") as dense, open_source(tmp_path / "set-fp8-block" / "expert0") as quantized:
        assert quantized.infos().keys() == dense.infos().keys()
        for name in dense.infos():
            want, got = dense.load(name).float(), quantized.load(name).float()
            if ".layers." in name and name.endswith("_proj.weight"):
                assert float((got - want).abs().max()) <= 2**-4 * float(want.abs().max())
            else:
                assert torch.equal(got, want)


def test_merge_distances_norms_and_sweep(tmp_path, capsys):
    """Frobenius norms over the method tensors only (the averaged ones are not the method's), each WUDI snapshot's
    distances to both ends, snapshots in step order: checked on deltas whose distances are exact in float64."""
    from safetensors.torch import save_file

    from specmerge_bench.accuracy.merging import Candidate

    def store(key: str, values: tuple[float, float], extra: float = 0.0) -> None:
        tensors = {"method/a": torch.tensor([values[0]]), "method/b": torch.tensor([[values[1]]]),
                   "averaged/c": torch.tensor([extra])}  # fmt: skip
        save_file(tensors, tmp_path / f"{key}.safetensors")

    store("task_arithmetic-0000000000", (3.0, 4.0), extra=100.0)  # norm 5
    store("closed_form-0000000000", (3.0, -8.0))  # 12 from TA
    store(Candidate("wudi_steps", "wudi", {"steps": 1000}).key, (3.0, 1.0))  # 3 from TA, 9 to D C+
    store(Candidate("wudi_steps", "wudi", {"steps": 100}).key, (6.0, 8.0))  # norm 10; 5 from TA, sqrt(265) to D C+
    run_script("merge_distances.py", "--merges", str(tmp_path))
    out = capsys.readouterr().out
    assert "| task_arithmetic-0000000000 | 5.0 |" in out and "| closed_form-0000000000 | 8.5 |" in out, out
    sweep = out[out.index("| WUDI steps |") :].splitlines()[2:]
    assert sweep == ["| 100 | 5.0 | 16.3 |", "| 1,000 | 3.0 | 9.0 |", "| D C⁺ | 12.0 | 0 |"], out
    bad = tmp_path / f"{Candidate('wudi_steps', 'wudi', {'steps': 500}).key}.safetensors"
    bad.write_bytes(b"\xff" * 16)  # a header length no file this size can hold
    with pytest.raises(SystemExit):
        run_script("merge_distances.py", "--merges", str(tmp_path))
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and bad.name in err and "not a readable safetensors file" in err, err


def test_merge_distances_task_vectors(tmp_path, capsys):
    """Each LoRA expert's task vector scale * B @ A (the config's alpha / r applied) and their sum, in exact figures;
    an adapter whose config does not describe its weights is one line naming it."""
    from specmerge.io.formats.peft_write import adapter_config, write_adapter
    from specmerge.linalg.lowrank import AdapterFactors

    def adapter(name: str, factors: dict[str, tuple[float, float]]) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        pairs = {k: AdapterFactors(torch.tensor([[b]]), torch.tensor([[a]]), 0.0) for k, (b, a) in factors.items()}
        config = {**adapter_config(dict.fromkeys(factors, 1), base_model="tiny"), "lora_alpha": 2}  # scale 2
        write_adapter(folder, pairs, config)
        return folder

    adapter("a", {"x.w1.weight": (1.0, 1.5), "x.w2.weight": (2.0, 1.0)})  # deltas 3, 4: norm 5
    adapter("b", {"x.w1.weight": (-1.5, 1.0), "x.w2.weight": (4.0, 1.0)})  # deltas -3, 8: norm sqrt(73)
    (tmp_path / "not-an-adapter").mkdir()
    run_script("merge_distances.py", "--adapters", str(tmp_path))
    out = capsys.readouterr().out.splitlines()
    assert out[2:] == ["| a | 2 | 5.0 |", "| b | 2 | 8.5 |", "| sum (task arithmetic, s = 1) | 2 | 12.0 |"], out
    bad = adapter("c", {"x.w1.weight": (1.0, 1.0)})
    (bad / "adapter_config.json").write_text(
        json.dumps({**adapter_config({"x.w1.weight": 1}, base_model="tiny"), "r": 2})
    )
    with pytest.raises(SystemExit):
        run_script("merge_distances.py", "--adapters", str(tmp_path))
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "c/adapter_config.json" in err and "rank" in err, err


def test_specmerge_bench_refuses_bad_inputs_in_one_line(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    for argv, message in [
        (["accuracy", "--cache", str(tmp_path / "a-file")], "is a file; give a folder"),
        (["accuracy", "--cache", str(tmp_path), "--seeds", "0", "0"], "--seeds must be distinct"),
        (["accuracy"], "the following arguments are required: --cache"),
        (["nope"], "invalid choice: 'nope'"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            bench_main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and message in err and len(err.splitlines()) == 1, (argv, err)


def test_compute_floor_whole_model_with_before_src(family, capsys):
    """--models with --before-src: the older code's merge (here the same src/, in a child process), both routes of
    this one, and each one's difference from the partial route, which is round-off only when the code is the same."""
    src = Path(__file__).resolve().parents[1] / "src"
    run_script("compute_floor.py", "--models", str(family), "--before-src", str(src), "--repeats", "1")
    out = capsys.readouterr().out
    for row in (f"| before ({src}) |", "| partial |", "| eigh |"):
        assert row in out, out
    for other in ("before", "eigh"):
        prefix = f"largest relative difference of a merged tensor, partial against {other}: "
        line = next(line for line in out.splitlines() if line.startswith(prefix))
        # tiny layers take eigh on both routes and in both processes, with the same thread count: the same float32
        # operations, so any difference is a few float32 roundings (eps 1.2e-7) of well-conditioned sums
        assert float(line.split(": ")[1].split()[0]) <= 1e-5, line


def test_compute_floor_names_a_failed_before_merge(tmp_path, family, capsys):
    broken = tmp_path / "src" / "specmerge"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise RuntimeError('broken on purpose')\n")
    with pytest.raises(SystemExit) as exit_:
        run_script("compute_floor.py", "--models", str(family), "--before-src", str(tmp_path / "src"))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and len(err.splitlines()) == 1, err
    assert "the --before-src merge failed (exit 1): RuntimeError: broken on purpose" in err, err


def test_compute_floor_route_accuracy_names_each_route(family, capsys):
    """The check run on the tensor that differs most: SWUDI-A through both routes, each against float64."""
    floor = runpy.run_path(str(BENCH / "compute_floor.py"))
    name, experts = "model.layers.0.mlp.down_proj.weight", [family / "expert0", family / "expert1"]
    floor["route_accuracy"](family / "base", experts, name)
    out = capsys.readouterr().out
    assert out.startswith(f"SWUDI-A on {name} (") and "float32 against float64 (K " in out, out
    kept = int(out.split("(K ")[1].split(")")[0])
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith(("| partial |", "| eigh |"))]
    assert len(rows) == 2 and all(int(row[2]) == kept for row in rows), out
    # Davis-Kahan: a backward error of eps_32 lambda_1 turns the kept subspace by at most eps_32 lambda_1 / gap_K
    with open_source(family / "base") as base:
        weight = base.load(name)
    stack = []
    for expert in experts:
        with open_source(expert) as source:
            stack.append(source.load(name) - weight)
    stack = torch.stack(stack).double()
    rows_m = (stack / stack.flatten(1).norm(dim=1)[:, None, None]).reshape(-1, stack.shape[2])
    lam = torch.linalg.eigvalsh(rows_m.T @ rows_m).flip(0)
    bound = torch.finfo(torch.float32).eps * float(lam[0] / (lam[kept - 1] - lam[kept]))
    for row in rows:
        assert float(row[3].rstrip(" |")) <= bound, (out, bound)


def test_val_test_shift_statistics_agree_with_each_other_and_by_hand():
    shift = runpy.run_path(str(BENCH / "val_test_shift.py"))  # not as __main__: its functions
    val, test = torch.tensor([1, 0, 0, -1]), torch.tensor([1, 1, 0, 0, 0, 0, 0, 0])
    by_hand = (float(val.double().var()) / 4 + float(test.double().var()) / 8) ** 0.5 * 100
    assert math.isclose(shift["shift_error"]({"t": (val, test)}), by_hand, rel_tol=1e-12)
    assert math.isclose(shift["shift_error"]({"t": (val, test), "u": (val, test)}), by_hand / 2**0.5, rel_tol=1e-12)

    # two tasks whose val and test come from one distribution: the re-split shifts are centred on 0, and their
    # spread is the sentence-level standard error (both estimate one sampling std; they differ by the Monte Carlo
    # error of a std from `draws` samples, about 1 / sqrt(2 draws), and the split-to-pooled variance difference)
    generator = torch.Generator().manual_seed(1)
    pairs = {t: tuple(torch.randint(-1, 2, (n,), generator=generator) for n in (300, 600)) for t in "ab"}
    draws = 4000
    shifts = shift["resplit_shifts"](pairs, draws, seed=3)
    assert shifts.shape == (draws,) and torch.equal(shifts, shift["resplit_shifts"](pairs, draws, seed=3))
    error = shift["shift_error"](pairs)
    assert abs(float(shifts.mean())) < 4 * error / draws**0.5
    assert abs(float(shifts.std()) / error - 1) < 4 / (2 * draws) ** 0.5 + 0.05
    # a split with every +1 in test: the observed shift is far outside the re-split spread
    skewed = {"a": (torch.zeros(300, dtype=torch.long), torch.ones(600, dtype=torch.long))}
    assert float(shift["resplit_shifts"](skewed, 200).abs().max()) < 100.0 - 1e-9
