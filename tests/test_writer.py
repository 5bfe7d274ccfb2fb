"""ShardWriter layout and bytes, atomic output folders, model-file copying, a from_pretrained round trip."""

import json
import struct
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file

from specmerge.io.formats.names import safetensors_dtype
from specmerge.io.formats.protocol import TensorInfo
from specmerge.io.formats.sources import open_source
from specmerge.io.output.folder import OutputExistsError, atomic_directory
from specmerge.io.output.model_files import copy_model_files
from specmerge.io.output.writer import ShardWriter


def tensors() -> dict[str, torch.Tensor]:
    return {
        "a.weight": torch.randn(4, 5),  # 80 bytes
        "a.bias": torch.randn(5).to(torch.bfloat16),  # 10
        "b.weight": torch.randn(3, 3).half(),  # 18
        "ids": torch.arange(7),  # 56
        "mask": torch.tensor([True, False, True]),  # 3
        "big": torch.randn(50, dtype=torch.float64),  # 400
        "scalar": torch.tensor(1.5),  # 4
    }


def plan(values: dict[str, torch.Tensor]) -> list[TensorInfo]:
    return [TensorInfo(n, tuple(t.shape), t.dtype) for n, t in values.items()]


def write_all(directory, values, order=None, **kwargs):
    writer = ShardWriter(directory, plan(values), **kwargs)
    for name in order or values:
        writer.write(name, values[name])
    return writer.close()


def read_header(path) -> dict:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    assert length % 8 == 0
    header = json.loads(data[8 : 8 + length])
    ends = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    start = 0
    for lo, hi in ends:  # contiguous data, covering the file exactly
        assert lo == start
        start = hi
    assert 8 + length + start == len(data)
    return header


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


def test_safetensors_dtype_codes():
    assert safetensors_dtype(torch.bfloat16) == "BF16"
    assert safetensors_dtype(torch.float16) == "F16"
    assert safetensors_dtype(torch.int64) == "I64"
    assert safetensors_dtype(torch.bool) == "BOOL"
    assert safetensors_dtype(torch.float8_e4m3fn) == "F8_E4M3"
    with pytest.raises(ValueError, match=r"complex64 cannot be stored in safetensors"):
        safetensors_dtype(torch.complex64)


def test_one_shard_is_model_safetensors_with_exact_bytes(tmp_path):
    values = tensors()
    files = write_all(tmp_path, values, order=reversed(list(values)), metadata={"merged_by": "specmerge"})
    assert files == [tmp_path / "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    assert_same(load_file(tmp_path / "model.safetensors"), values)
    header = read_header(tmp_path / "model.safetensors")
    assert header["__metadata__"] == {"format": "pt", "merged_by": "specmerge"}
    assert header["a.bias"] == {"dtype": "BF16", "shape": [5], "data_offsets": header["a.bias"]["data_offsets"]}
    assert header["scalar"]["shape"] == []


def test_layout_aligns_every_tensor_to_its_element_size(tmp_path):
    values = tensors()
    write_all(tmp_path, values)
    header = read_header(tmp_path / "model.safetensors")
    for name, tensor in values.items():
        assert header[name]["data_offsets"][0] % tensor.element_size() == 0, name
    # float64 first, then 4-byte and so on; plan order within one element size.
    order = sorted((v["data_offsets"][0], k) for k, v in header.items() if k != "__metadata__")
    assert [k for _, k in order] == ["ids", "big", "a.weight", "scalar", "a.bias", "b.weight", "mask"]


@pytest.mark.parametrize(
    ("limit", "expected"),
    [
        (10**6, [["a.weight", "a.bias", "b.weight", "ids", "mask", "big", "scalar"]]),
        (170, [["a.weight", "a.bias", "b.weight", "ids", "mask"], ["big"], ["scalar"]]),
        (120, [["a.weight", "a.bias", "b.weight"], ["ids", "mask"], ["big"], ["scalar"]]),
        (1, [[name] for name in tensors()]),
    ],
)
def test_sharding_boundaries_and_index(tmp_path, limit, expected):
    values = tensors()
    files = write_all(tmp_path, values, order=sorted(values), max_shard_bytes=limit)
    count = len(expected)
    if count == 1:
        assert [p.name for p in files] == ["model.safetensors"]
        assert_same(load_file(files[0]), values)
        return
    names = [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert [p.name for p in files] == [*names, "model.safetensors.index.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in files)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": sum(t.numel() * t.element_size() for t in values.values())}
    assert list(index["weight_map"]) == list(values)
    for file, members in zip(names, expected, strict=True):
        assert [n for n, f in index["weight_map"].items() if f == file] == members
        assert_same(load_file(tmp_path / file), {n: values[n] for n in members})
    assert_same({n: open_source(tmp_path).load(n) for n in values}, values)


def test_writes_any_layout_of_the_input_tensor(tmp_path):
    transposed = torch.randn(5, 4).t()  # not contiguous
    sliced = torch.randn(6, dtype=torch.bfloat16)[::2]
    values = {"t": transposed, "s": sliced, "empty": torch.zeros(0, 3), "fp8": torch.randn(4).to(torch.float8_e4m3fn)}
    write_all(tmp_path, values)
    loaded = load_file(tmp_path / "model.safetensors")
    assert torch.equal(loaded["t"], transposed) and torch.equal(loaded["s"], sliced)
    assert loaded["empty"].shape == (0, 3)
    assert torch.equal(loaded["fp8"].view(torch.uint8), values["fp8"].view(torch.uint8))


def test_concurrent_writes(tmp_path):
    values = {f"w{i}": torch.randn(64, 32) for i in range(40)}
    writer = ShardWriter(tmp_path, plan(values), max_shard_bytes=64 * 32 * 4 * 3)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda item: writer.write(*item), values.items()))
    writer.close()
    assert_same({n: open_source(tmp_path).load(n) for n in values}, values)


def test_empty_plan_writes_an_empty_checkpoint(tmp_path):
    assert ShardWriter(tmp_path, []).close() == [tmp_path / "model.safetensors"]
    assert load_file(tmp_path / "model.safetensors") == {}


def test_write_errors(tmp_path):
    values = tensors()
    writer = ShardWriter(tmp_path, plan(values))
    with pytest.raises(
        ValueError, match=r"tensor 'a\.weight': expected shape \[4, 5\] torch\.float32, got shape \[5, 4\]"
    ):
        writer.write("a.weight", values["a.weight"].t())
    with pytest.raises(
        ValueError, match=r"tensor 'a\.bias': expected shape \[5\] torch\.bfloat16, got .*torch\.float32"
    ):
        writer.write("a.bias", values["a.bias"].float())
    with pytest.raises(ValueError, match=r"tensor 'c\.weight' is not in the write plan \(7 planned tensors\)"):
        writer.write("c.weight", values["a.weight"])
    writer.write("a.weight", values["a.weight"])
    with pytest.raises(ValueError, match=r"tensor 'a\.weight' was already written"):
        writer.write("a.weight", values["a.weight"])
    with pytest.raises(ValueError, match=r"6 planned tensor\(s\) were never written: 'a\.bias', .*, 'big', \.\.\."):
        writer.close()
    with pytest.raises(ValueError, match=r"writer is closed"):
        writer.write("a.bias", values["a.bias"])


def test_plan_errors(tmp_path):
    info = TensorInfo("w", (2,), torch.float32)
    with pytest.raises(ValueError, match=r"tensor 'w' appears twice in the write plan"):
        ShardWriter(tmp_path, [info, info])
    with pytest.raises(ValueError, match=r"complex64 cannot be stored"):
        ShardWriter(tmp_path, [TensorInfo("z", (2,), torch.complex64)])
    with pytest.raises(ValueError, match=r"metadata must map strings to strings"):
        ShardWriter(tmp_path, [info], metadata={"steps": 3})
    with pytest.raises(ValueError, match=r"does not exist"):
        ShardWriter(tmp_path / "missing", [info])
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=r"model\.safetensors already exists; write into an empty folder"):
        ShardWriter(tmp_path, [info])


def test_context_manager_closes_or_aborts(tmp_path):
    with ShardWriter(tmp_path / ".", [TensorInfo("w", (2,), torch.float32)]) as writer:
        writer.write("w", torch.ones(2))
    assert torch.equal(load_file(tmp_path / "model.safetensors")["w"], torch.ones(2))
    (tmp_path / "b").mkdir()
    with pytest.raises(RuntimeError, match="boom"), ShardWriter(tmp_path / "b", plan(tensors())) as writer:
        writer.write("a.weight", tensors()["a.weight"])
        raise RuntimeError("boom")
    assert not (tmp_path / "b" / "model.safetensors.index.json").exists()


def test_atomic_directory_success_and_failure(tmp_path):
    target = tmp_path / "out"
    with atomic_directory(target) as work:
        assert work.parent.parent == tmp_path and work.parent.name.startswith(".out.specmerge-tmp-")
        (work / "f.txt").write_text("done")
    assert (target / "f.txt").read_text() == "done"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]

    with pytest.raises(RuntimeError, match="boom"), atomic_directory(tmp_path / "failed") as work:
        (work / "half.bin").write_bytes(b"x")
        raise RuntimeError("boom")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_atomic_directory_refuses_or_replaces_an_existing_target(tmp_path):
    target = tmp_path / "out"
    with atomic_directory(target) as work:  # --overwrite replaces only specmerge's own output
        (work / "old.txt").write_text("old")
    with pytest.raises(OutputExistsError, match=r"out already exists; pass --overwrite .* or choose another path"):
        atomic_directory(target).__enter__()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert issubclass(OutputExistsError, FileExistsError) and issubclass(OutputExistsError, ValueError)

    with pytest.raises(RuntimeError), atomic_directory(target, overwrite=True) as work:
        (work / "new.txt").write_text("new")
        raise RuntimeError("failed merge")
    assert sorted(p.name for p in target.iterdir()) == [".specmerge", "old.txt"]  # it survives a failed overwrite

    with atomic_directory(target, overwrite=True) as work:
        (work / "new.txt").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == [".specmerge", "new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]

    with atomic_directory(tmp_path / "missing" / "out") as work:  # a missing parent is created (issue 16)
        (work / "new.txt").write_text("new")
    assert [p.name for p in (tmp_path / "missing" / "out").iterdir()] == [".specmerge", "new.txt"]
    with pytest.raises(RuntimeError), atomic_directory(tmp_path / "gone" / "deeper" / "out"):
        raise RuntimeError("failed merge")
    assert not (tmp_path / "gone").exists()  # and removed when the block fails


def test_copy_model_files(tmp_path):
    base, out = tmp_path / "base", tmp_path / "out"
    base.mkdir()
    out.mkdir()
    keep = [
        "added_tokens.json", "chat_template.jinja", "config.json", "configuration_custom.py", "generation_config.json",
        "merges.txt", "preprocessor_config.json", "qwen.tiktoken", "special_tokens_map.json", "tokenizer.json",
        "tokenizer.model", "tokenizer_config.json", "video_preprocessor_config.json", "vocab.json",
    ]  # fmt: skip
    drop = ["README.md", "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "training_args.pt"]
    for name in keep + drop:
        (base / name).write_text(name)
    (base / "onnx").mkdir()
    (base / "onnx" / "config.json").write_text("{}")
    assert copy_model_files(base, out) == keep
    assert sorted(p.name for p in out.iterdir()) == keep
    assert (out / "config.json").read_text() == "config.json"
    assert copy_model_files(base / "model.safetensors", tmp_path / "elsewhere") == []


def test_transformers_round_trip(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128,
    )  # fmt: skip
    original = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    original.save_pretrained(tmp_path / "base")

    with open_source(tmp_path / "base") as source, atomic_directory(tmp_path / "merged") as work:
        infos = list(source.infos().values())
        writer = ShardWriter(work, infos, max_shard_bytes=16 * 1024, metadata={"specmerge": "test"})
        for info in reversed(infos):
            writer.write(info.name, source.load(info.name))
        files = writer.close()
        copied = copy_model_files(tmp_path / "base", work)
    assert len(files) > 3 and files[-1].name == "model.safetensors.index.json"
    assert "config.json" in copied and "generation_config.json" in copied

    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert_same(loaded.state_dict(), original.state_dict())


@pytest.mark.parametrize("fsync", [True, False])
def test_shards_are_synced_while_written_and_when_full_unless_asked_not_to(tmp_path, monkeypatch, fsync):
    import os

    from specmerge.io.output import writer as writer_module

    calls = []
    real_fsync, real_fdatasync = os.fsync, os.fdatasync
    monkeypatch.setattr(os, "fsync", lambda fd: calls.append(("fsync", fd)) or real_fsync(fd))
    monkeypatch.setattr(os, "fdatasync", lambda fd: calls.append(("fdatasync", fd)) or real_fdatasync(fd))
    monkeypatch.setattr(writer_module, "SYNC_BYTES", 3 * 64 * 32 * 4)  # a background sync every 3 tensors
    values = {f"w{i}": torch.randn(64, 32) for i in range(20)}
    files = write_all(tmp_path, values, max_shard_bytes=64 * 32 * 4 * 10, fsync=fsync)
    assert_same({n: open_source(tmp_path).load(n) for n in values}, values)
    assert len(files) == 3  # two shards and the index
    if not fsync:
        assert calls == []
        return
    assert [kind for kind, _ in calls].count("fsync") == 2  # once per shard, when it is full
    assert [kind for kind, _ in calls].count("fdatasync") >= 2  # and in the background while it is written
