"""Property-based fuzzing of every reader of user files (issue 13).

The promise under test: whatever bytes a user points specmerge at, a reader either returns a correct
result or raises the project's one-line error type (:class:`specmerge.errors.SpecmergeError`) — never
another exception, never a traceback. Four readers: the safetensors header reader (through
``open_source``), the checkpoint index reader, the PEFT ``adapter_config.json`` reader and the recipe
loader. Each is fuzzed twice: with arbitrary bytes, and with structured inputs near the valid ones
(valid files with one field changed), where the interesting bugs live.
"""

from __future__ import annotations

import json
import math
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from specmerge.errors import SpecmergeError
from specmerge.io.formats.peft import open_adapter
from specmerge.io.formats.sources import open_source
from specmerge.pipeline.recipe.model import Recipe, load_recipe

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
DTYPE_CODES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "C64", "X", ""]


def _read_everything(path: Path) -> None:
    """Open a checkpoint and read every tensor (and a row block of each), as a merge would."""
    with open_source(path) as source:
        for name, info in source.infos().items():
            tensor = source.load(name)
            assert tuple(tensor.shape) == info.shape and tensor.dtype == info.dtype
            if info.shape and info.shape[0]:
                assert tuple(source.load(name, rows=(0, 1)).shape) == (1, *info.shape[1:])


def _expect_clean(path: Path) -> None:
    """Reading either succeeds or raises SpecmergeError with a one-line message naming something."""
    try:
        _read_everything(path)
    except SpecmergeError as err:
        message = str(err)
        assert message and "\n" not in message, f"not one line: {message!r}"


def _safetensors_bytes(header: object, data: bytes, length: int | None = None) -> bytes:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


@FUZZ
@given(blob=st.binary(max_size=300))
def test_safetensors_arbitrary_bytes(blob: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        path.write_bytes(blob)
        _expect_clean(path)


@FUZZ
@given(
    dtype=st.sampled_from(DTYPE_CODES),
    shape=st.lists(st.integers(-2, 5) | st.sampled_from([2**40, 2**63]), max_size=3),
    offsets=st.lists(st.integers(-4, 80) | st.sampled_from([2**64, 2**63 + 1]), min_size=0, max_size=3),
    data=st.binary(max_size=80),
    length_delta=st.sampled_from([0, 0, 0, 1, -1, 7, 2**40]),
    metadata=st.none() | json_values,
    extra=st.none() | json_values,
)
def test_safetensors_near_valid_headers(dtype, shape, offsets, data, length_delta, metadata, extra) -> None:
    header: dict = {"w": {"dtype": dtype, "shape": shape, "data_offsets": offsets}}
    if metadata is not None:
        header["__metadata__"] = metadata
    if extra is not None:
        header["x"] = extra
    raw = json.dumps(header).encode()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        path.write_bytes(_safetensors_bytes(raw, data, max(0, len(raw) + length_delta)))
        _expect_clean(path)


def test_safetensors_valid_file_reads_back(tmp_path: Path) -> None:
    """The fuzz harness accepts a valid file (so the properties above are not vacuous)."""
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    _read_everything(tmp_path / "model.safetensors")
    with open_source(tmp_path / "model.safetensors") as source:
        assert torch.equal(source.load("a"), tensors["a"])


@pytest.fixture(scope="module")
def shard_folder() -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        save_file({"a": torch.ones(2, 2)}, str(folder / "model-00001-of-00002.safetensors"))
        save_file({"b": torch.zeros(3)}, str(folder / "model-00002-of-00002.safetensors"))
        yield folder


shard_names = st.sampled_from(
    [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "missing.safetensors",
        "../model-00001-of-00002.safetensors",
        "/etc/passwd",
        "",
        ".",
        "..",
        "sub/x.safetensors",
        "model.safetensors.index.json",
    ]
)


@FUZZ
@given(
    weight_map=st.dictionaries(st.sampled_from(["a", "b", "c", ""]), shard_names | json_scalars, max_size=4)
    | json_values,
    metadata=st.none() | json_values,
)
def test_index_reader(shard_folder: Path, weight_map, metadata) -> None:
    index = {"weight_map": weight_map} if metadata is None else {"metadata": metadata, "weight_map": weight_map}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        folder.mkdir()
        for shard in shard_folder.iterdir():
            (folder / shard.name).write_bytes(shard.read_bytes())
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        try:
            with open_source(folder) as source:
                infos = source.infos()
                for name in infos:
                    source.load(name)
        except SpecmergeError as err:
            assert "\n" not in str(err)
            return
        # Accepted: every tensor the index names comes from a shard inside the folder.
        assert isinstance(weight_map, dict)
        for file_name in weight_map.values():
            assert (folder / file_name).resolve().parent == folder.resolve()


@FUZZ
@given(text=st.text(max_size=200))
def test_index_reader_arbitrary_text(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "model.safetensors.index.json").write_text(text)
        _expect_clean(folder)


ADAPTER_KEYS = {
    "peft_type": st.sampled_from(["LORA", "IA3", None, 3]),
    "r": st.integers(-2, 20) | json_scalars,
    "lora_alpha": st.integers(-2, 40) | st.floats() | json_scalars,
    "use_rslora": st.booleans() | json_scalars,
    "fan_in_fan_out": st.booleans() | json_scalars,
    "rank_pattern": st.dictionaries(st.sampled_from(["q_proj", "(", "*", ""]), st.integers(-1, 8) | json_scalars)
    | json_values,
    "alpha_pattern": st.dictionaries(st.sampled_from(["q_proj", "[", ""]), st.integers(-1, 8) | json_scalars)
    | json_values,
    "target_modules": json_values,
    "use_dora": st.booleans(),
}


@pytest.mark.filterwarnings("ignore::specmerge.errors.SpecmergeWarning")
@FUZZ
@given(
    config=st.fixed_dictionaries({}, optional=ADAPTER_KEYS) | json_values,
    rank=st.integers(1, 4),
)
def test_adapter_config_reader(config, rank: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        prefix = "base_model.model.layers.0.q_proj"
        save_file(
            {f"{prefix}.lora_A.weight": torch.randn(rank, 6), f"{prefix}.lora_B.weight": torch.randn(5, rank)},
            str(folder / "adapter_model.safetensors"),
        )
        (folder / "adapter_config.json").write_text(json.dumps(config))
        try:
            adapter = open_adapter(folder)
        except SpecmergeError as err:
            assert "\n" not in str(err)
            return
        # Accepted: the modules it reports agree with the factors on disk.
        try:
            for module in adapter.modules().values():
                assert module.rank == rank
                assert math.isfinite(module.scale) and module.scale > 0
        finally:
            adapter.close()


@FUZZ
@given(text=st.text(max_size=300))
def test_recipe_loader_arbitrary_text(text: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "recipe.yaml"
        path.write_text(text, encoding="utf-8")
        try:
            load_recipe(path)
        except SpecmergeError as err:
            assert "\n" not in str(err)


RECIPE_KEYS = {
    "base": st.sampled_from(["base", "", "/x"]) | json_scalars,
    "experts": st.lists(st.sampled_from(["e1", "e2", "e1", ""]) | json_scalars, max_size=3) | json_values,
    "method": st.sampled_from(["swudi_a", "swudi", "ties", "dare", "task_arithmetic", "nope"]) | json_scalars,
    "params": st.dictionaries(
        st.sampled_from(["scale", "rule", "t", "rank_ratio", "density", "k", "seed", "x"]),
        st.floats() | st.integers(-3, 3) | st.sampled_from(["psqrt", "nan", "inf", "1e400"]) | json_scalars,
        max_size=3,
    )
    | json_values,
    "overrides": st.lists(
        st.fixed_dictionaries(
            {},
            optional={
                "pattern": st.sampled_from(["*", "*.weight", "", "[", "x"]) | json_scalars,
                "action": st.sampled_from(["merge", "average", "keep_base", "x"]) | json_scalars,
                "method": st.sampled_from(["ties", "swudi_a", "x"]) | json_scalars,
                "params": json_values,
            },
        )
        | json_values,
        max_size=3,
    )
    | json_values,
    "dtype": st.sampled_from(["auto", "float32", "bfloat16", "int8"]) | json_scalars,
    "compute_dtype": st.sampled_from(["float32", "float64", "float16"]) | json_scalars,
    "device": st.sampled_from(["cpu", "cuda:0", "auto", "tpu", "cuda:-1"]) | json_scalars,
    "shard_size": st.sampled_from(["5GB", "", "0", "1.5GiB", "-1MB", "nan GB", "inf"]) | json_scalars,
    "output_format": st.sampled_from(["model", "lora", "x"]) | json_scalars,
    "max_rank": st.integers(-1, 3) | json_scalars,
    "expert_keys": st.lists(st.text(max_size=3), max_size=3) | json_values,
    "non_matrix": st.sampled_from(["average", "keep_base", "x"]) | json_scalars,
}


@FUZZ
@given(
    data=st.fixed_dictionaries(
        {"base": st.just("base"), "experts": st.just(["e1", "e2"])},
        optional={k: v for k, v in RECIPE_KEYS.items() if k not in ("base", "experts")},
    )
    | st.fixed_dictionaries({}, optional=RECIPE_KEYS)
    | json_values
)
def test_recipe_from_structured_data(data) -> None:
    try:
        recipe = Recipe.from_dict(data)
    except SpecmergeError as err:
        assert "\n" not in str(err)
        return
    # Accepted: every float parameter is finite (scale = nan must never reach a merge) and it round-trips.
    for value in recipe.params.values():
        if isinstance(value, float):
            assert not math.isnan(value)
    assert recipe.shard_bytes >= 1
    import yaml

    assert Recipe.from_dict(yaml.safe_load(recipe.to_yaml())) == recipe


# The command line: every value typed after a generated flag (and every `-p key=value` pair, every inspect
# method spec) is either accepted as a recipe would accept it or refused with one line and exit status 2.
MERGE_FLAGS = ["--dtype", "--device", "--shard-size", "--output-format", "--max-rank", "--non-matrix"]
MERGE_FLAGS += ["--compute-dtype", "--method", "--param", "--expert-key"]
typed_text = st.text(max_size=14) | st.sampled_from(["", "null", "true", ".inf", "[1", "{a: 1}", "5GB", "scale=0.5"])


@FUZZ
@given(flags=st.lists(st.tuples(st.sampled_from(MERGE_FLAGS), typed_text), max_size=4))
def test_command_line_values(flags) -> None:
    import contextlib
    import io

    from specmerge.cli import main
    from specmerge.pipeline.run import api

    seen = []
    argv = ["merge", "base", "expert", "-o", "out", *(f"{flag}={value}" for flag, value in flags)]
    stderr = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(None):
        patch.setattr(api, "run_recipe", lambda recipe, output, **kw: seen.append(recipe) or _no_report(recipe))
        status = main(argv)
    err = stderr.getvalue()
    if status == 0:
        assert len(seen) == 1 and not err
    else:
        assert status == 2 and err.startswith("specmerge: error: ") and err.count("\n") == 1, err


def _no_report(recipe: Recipe) -> dict:
    return {"tensors": [], "method": recipe.method, "seconds": 0.0}


@FUZZ
@given(spec=st.text(max_size=30) | st.sampled_from(["swudi:t=", "ties:density=2", "swudi_a:rule=x,", "x:y"]))
def test_inspect_method_specs(spec: str) -> None:
    from specmerge.diagnostics.options import InspectOptions

    try:
        options = InspectOptions(methods=(spec,))
    except SpecmergeError as err:
        assert "\n" not in str(err)
        return
    assert options.methods == (spec,)
