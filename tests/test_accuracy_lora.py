"""The accuracy benchmark's LoRA track on a tiny BERT: PEFT adapters, merged through specmerge's adapter path."""
# ruff: noqa: F811  (the fixtures imported from test_accuracy_model are parameters here)

import json
from pathlib import Path

import peft
import pytest
import safetensors.torch
import torch
import transformers

import specmerge
import specmerge_bench.accuracy.experts as stages
from specmerge_bench.accuracy import bench, lora, rows
from specmerge_bench.accuracy.merging import merge_candidates
from test_accuracy_model import tiny_model_dir, world  # noqa: F401  (fixtures)

# Every registered method with an exact merge on LoRA factors, at its registry defaults (plus a SWUDI setting).
FACTORED = [
    ("weight_average", {}),
    ("task_arithmetic", {}),
    ("tsv_m", {}),
    ("iso_c", {}),
    ("closed_form", {}),
    ("swudi", {"rank_ratio": 0.5, "t": 300.0}),
    ("swudi_a", {}),
    ("spectral_filter", {}),
]
RANK = 4
# WUDI has no factored form: on adapters it takes the dense route (the LoRA track's step sweep relies on it).
ROUTES = [(m, p, "factored") for m, p in FACTORED] + [("wudi", {"steps": 5}, "dense")]


@pytest.fixture(scope="module")
def adapters(world, tiny_model_dir):
    """The LoRA experts of seed 0 for both tasks, built by the benchmark's own stage; rank 4 (of the tiny model's
    32 dimensions) so that, as with rank 16 on MiniLM's 384, the adapters span a small subspace."""
    run = {"steps": 30, "lr": 1e-2, "batch_size": 16, "model_dir": tiny_model_dir, "manifest": world["manifest"]}
    run["rank"] = RANK
    return stages.build_experts(world["cache"], seeds=(0,), track="lora", **run)


def test_lora_experts_are_peft_adapters_on_the_encoder_linear_layers(world, adapters, tiny_model_dir, monkeypatch):
    base = world["model"].state_dict()
    linear = {f"encoder.layer.{i}.{m}.weight" for i in range(2) for m in
              ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
               "intermediate.dense", "output.dense")}  # fmt: skip
    for task, folder in adapters["paths"]["experts"][0].items():
        config = json.loads((Path(folder) / "adapter_config.json").read_text())
        assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", RANK, 2 * RANK), task
        factors = safetensors.torch.load_file(Path(folder) / "adapter_model.safetensors")
        assert len(factors) == 2 * len(linear) and all(".lora_A." in k or ".lora_B." in k for k in factors)
        dense = lora.dense_expert(world["model"], folder)
        assert {name for name in base if not torch.equal(dense[name], base[name])} == linear, task
        assert 0.0 <= adapters["experts"][0][task]["val"][task] <= 1.0

    def refuse(*args, **kwargs):
        raise AssertionError("a cached LoRA expert was trained again")

    monkeypatch.setattr(peft, "get_peft_model", refuse)
    run = {"steps": 30, "lr": 1e-2, "batch_size": 16, "model_dir": tiny_model_dir, "manifest": world["manifest"]}
    again = stages.build_experts(world["cache"], seeds=(0,), track="lora", rank=RANK, **run)
    assert again["paths"] == adapters["paths"] and again["experts"][0]["colour"]["cached"]


@pytest.fixture(scope="module")
def dense_checkpoints(world, adapters, tmp_path_factory) -> list[Path]:
    """Each adapter's merge_and_unload weights in float64 (so the task vectors W_i - W_0 are B A to float64
    rounding), written as model folders."""
    out, folder = [], tmp_path_factory.mktemp("merge-and-unload")
    for task, adapter in adapters["paths"]["experts"][0].items():
        double = transformers.BertModel(world["model"].config, add_pooling_layer=False)
        double.load_state_dict(world["model"].state_dict())
        merged = peft.PeftModel.from_pretrained(double.double(), adapter).merge_and_unload()
        target = folder / task
        target.mkdir()
        safetensors.torch.save_file({k: v.contiguous() for k, v in merged.state_dict().items()},
                                    target / "model.safetensors")  # fmt: skip
        merged.config.to_json_file(target / "config.json")
        out.append(target)
    return out


@pytest.mark.parametrize(("method", "params", "route"), ROUTES, ids=[m for m, _, _ in ROUTES])
def test_the_adapter_path_equals_the_dense_merge_of_merge_and_unload_checkpoints(
    world,
    adapters,
    dense_checkpoints,
    tiny_model_dir,
    tmp_path,
    method,
    params,
    route,
):
    """The adapter path (the factored route where the method has one) and the dense route on the adapters'
    merged checkpoints, both computed in float64, agree to the float32 rounding of the stored result (a
    half-ulp each)."""
    dense = dense_checkpoints
    folders = list(adapters["paths"]["experts"][0].values())
    options = {"method": method, "params": params, "progress": False, "fsync": False, "compute_dtype": "float64",
               "merge_embeddings": False}  # fmt: skip
    factored = specmerge.merge(tiny_model_dir, folders, tmp_path / "from-adapters", **options)
    full = specmerge.merge(tiny_model_dir, dense, tmp_path / "from-checkpoints", **options)
    merged_weights = [t for t in factored["tensors"] if t["action"] == "merge" and len(t["shape"]) == 2]
    assert merged_weights and {t["diagnostics"]["route"] for t in merged_weights} == {route}
    assert {t["diagnostics"]["route"] for t in full["tensors"] if t["name"] in {w["name"] for w in merged_weights}} <= {
        "dense",
        "linear",
    }
    a = safetensors.torch.load_file(tmp_path / "from-adapters" / "model.safetensors")
    b = safetensors.torch.load_file(tmp_path / "from-checkpoints" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        spacing = 2 * torch.finfo(torch.float32).eps * float(a[name].abs().max().clamp(min=1e-30))
        assert float((a[name].double() - b[name].double()).abs().max()) <= spacing, (method, name)


def test_adapter_merger_records_routes_and_matches_the_in_memory_merge_over_the_scale_grid(
    world,
    adapters,
    tiny_model_dir,
):
    """AdapterMerger's deltas (merged file minus base) give the same merged models at every scale as the
    in-memory merge of the adapters' dense weights, to float32 rounding (linear methods: a few half-ulps)."""
    base = world["model"].state_dict()
    folders = list(adapters["paths"]["experts"][0].values())
    dense = [lora.dense_expert(world["model"], folder) for folder in folders]
    merger = lora.AdapterMerger(tiny_model_dir, base, folders, dense)
    candidates = [c for row in rows.method_rows() if row.label in ("task_arithmetic", "weight_average")
                  for c in row.candidates]  # fmt: skip
    got = merger(candidates, [5], progress=False)
    want = merge_candidates(base, dense, candidates, wudi_steps=[5], progress=False)
    for c in candidates:
        assert "factored" in got.routes[c.key] and set(got.routes[c.key]) <= {"factored", "unchanged"}
        for scale in bench.SCALES:
            a, b = got.state(base, c, scale), want.state(base, c, scale)
            for name in base:
                bound = 8 * torch.finfo(torch.float32).eps * float(base[name].abs().max().clamp(min=1))
                assert float((a[name] - b[name]).abs().max()) <= bound, (c.key, name)
    assert got.method[candidates[0].key]  # something was merged


def test_the_lora_track_end_to_end(world, tiny_model_dir, monkeypatch):
    """``run_benchmark(track="lora")``: the main-table rows merged from the adapter folders, routes recorded, the
    WUDI sweep on the dense deltas, no AdaMerging rows; a rerun reads every score from the cache."""
    kept = ("task_arithmetic", "ties", "tsv_m", "swudi", "wudi")  # a factored, a dense and an iterative row
    small = [r for r in rows.method_rows(grids={"swudi": {"rank_ratio": (0.5,), "t": (300.0,)}}) if r.label in kept]
    monkeypatch.setattr(bench, "method_rows", lambda: small)
    monkeypatch.setattr(rows, "WUDI_STEPS", (2, 5))
    monkeypatch.setattr(bench, "SCALES", (0.5, 1.0))
    run = {"model_dir": tiny_model_dir, "manifest": world["manifest"], "steps": 5, "progress": False}
    summary, folder = bench.run_benchmark(world["cache"], (0,), log=lambda line: None, track="lora", **run)
    assert folder.name.startswith("lora-")
    per_seed = json.loads((folder / "results.json").read_text())["per_seed"][0]
    assert not any(label.endswith("_adamerging") for label in summary["rows"])
    for row in small:
        assert row.label in summary["rows"]
    routes = per_seed["routes"]
    tsv = next(key for key in routes if key.startswith("tsv_m-"))
    ties = next(key for key in routes if key.startswith("ties-"))
    assert "factored" in routes[tsv] and "dense" in routes[ties]  # TIES densifies; TSV-M has a factored form

    def refuse(*args, **kwargs):
        raise AssertionError("a cached LoRA-track score was merged again")

    monkeypatch.setattr(lora.specmerge, "merge", refuse)
    again, _ = bench.run_benchmark(world["cache"], (0,), log=lambda line: None, track="lora", **run)
    assert again["rows"]["tsv_m"]["average"] == summary["rows"]["tsv_m"]["average"]
