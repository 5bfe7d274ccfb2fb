"""Lazy tensor sources: every checkpoint layout, infos without data reads, exact loads, clear errors."""

import json
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specmerge.io.formats.protocol import SourceError, TensorInfo, TensorSource
from specmerge.io.formats.sources import open_source


def tensors() -> dict[str, torch.Tensor]:
    return {
        "embed.weight": torch.randn(7, 3),
        "layer.0.weight": torch.randn(4, 3).to(torch.bfloat16),
        "layer.0.bias": torch.randn(4).half(),
        "layer.1.weight": torch.randn(2, 4, dtype=torch.float64),
        "position_ids": torch.arange(5).reshape(1, 5),
        "mask": torch.tensor([True, False, True]),
        "scale": torch.tensor(2.5),
    }


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name


def read_all(source: TensorSource) -> dict[str, torch.Tensor]:
    return {name: source.load(name) for name in source.infos()}


def write_raw_safetensors(path, header: dict, data_size: int) -> None:
    """A safetensors file from a hand-written header; the data region is left sparse (all zeros)."""
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + data_size)


def test_single_file_infos_in_stored_order_and_exact_loads(tmp_path):
    expected = tensors()
    save_file(expected, tmp_path / "w.safetensors")
    with open_source(tmp_path / "w.safetensors") as source:
        infos = source.infos()
        assert list(infos) == safe_open(str(tmp_path / "w.safetensors"), "pt").offset_keys()
        for name, tensor in expected.items():
            assert infos[name] == TensorInfo(name, tuple(tensor.shape), tensor.dtype)
            assert infos[name].nbytes == tensor.numel() * tensor.element_size()
        assert_same(read_all(source), expected)
        assert source.path == tmp_path / "w.safetensors"
        assert "w.safetensors" in source.describe()
        assert isinstance(source, TensorSource)


def test_infos_read_only_the_header(tmp_path):
    # An 8 GiB tensor declared in the header, stored as a sparse file: reading its data would take seconds.
    big = 2**31
    header = {
        "big": {"dtype": "F32", "shape": [big], "data_offsets": [0, 4 * big]},
        "small": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [4 * big, 4 * big + 8]},
    }
    try:
        write_raw_safetensors(tmp_path / "huge.safetensors", header, 4 * big + 8)
    except OSError:
        pytest.skip("the temporary file system does not support sparse files")
    start = time.perf_counter()
    with open_source(tmp_path / "huge.safetensors") as source:
        infos = source.infos()
        small = source.load("small")
    assert time.perf_counter() - start < 2
    assert infos["big"] == TensorInfo("big", (big,), torch.float32)
    assert infos["big"].nbytes == 8 * 2**30
    assert small.dtype == torch.bfloat16 and torch.equal(small, torch.zeros(2, 2, dtype=torch.bfloat16))


def sharded_folder(tmp_path, index_name="model.safetensors.index.json"):
    expected = tensors()
    names = list(expected)
    shards = {"model-00001-of-00002.safetensors": names[4:], "model-00002-of-00002.safetensors": names[:4]}
    weight_map = {}
    for file, members in shards.items():
        save_file({n: expected[n] for n in members}, tmp_path / file)
        weight_map.update(dict.fromkeys(members, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (tmp_path / index_name).write_text(json.dumps(index))
    return expected, shards


def test_sharded_folder_with_index(tmp_path):
    expected, shards = sharded_folder(tmp_path)
    with open_source(tmp_path) as source:
        infos = source.infos()
        # Shards in order of first appearance in the weight map, each in its stored order.
        first, second = (safe_open(str(tmp_path / f), "pt").offset_keys() for f in shards)
        assert list(infos) == first + second
        assert_same(read_all(source), expected)
        assert source.path == tmp_path
        assert "2 safetensors shards" in source.describe()


def test_index_file_can_be_passed_directly(tmp_path):
    expected, _ = sharded_folder(tmp_path, index_name="consolidated.safetensors.index.json")
    assert_same(read_all(open_source(tmp_path / "consolidated.safetensors.index.json")), expected)
    assert_same(read_all(open_source(tmp_path)), expected)  # the only index of the folder


def test_index_decides_which_shard_a_duplicated_tensor_is_read_from(tmp_path):
    save_file({"a": torch.zeros(2), "b": torch.ones(2)}, tmp_path / "one.safetensors")
    save_file({"a": torch.full((2,), 7.0)}, tmp_path / "two.safetensors")
    index = {"weight_map": {"a": "two.safetensors", "b": "one.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    source = open_source(tmp_path)
    assert list(source.infos()) == ["a", "b"]
    assert torch.equal(source.load("a"), torch.full((2,), 7.0))


def test_folder_with_model_safetensors_or_a_single_other_file(tmp_path):
    expected = tensors()
    (tmp_path / "a").mkdir()
    save_file(expected, tmp_path / "a" / "model.safetensors")
    save_file({"x": torch.zeros(1)}, tmp_path / "a" / "other.safetensors")  # model.safetensors wins
    assert_same(read_all(open_source(tmp_path / "a")), expected)
    (tmp_path / "b").mkdir()
    save_file(expected, tmp_path / "b" / "consolidated.safetensors")
    assert_same(read_all(open_source(str(tmp_path / "b"))), expected)


def test_pytorch_bin_folder_single_and_sharded(tmp_path):
    expected = tensors()
    (tmp_path / "single").mkdir()
    torch.save(expected, tmp_path / "single" / "pytorch_model.bin")
    with open_source(tmp_path / "single") as source:
        assert list(source.infos()) == list(expected)
        assert source.infos()["layer.0.weight"] == TensorInfo("layer.0.weight", (4, 3), torch.bfloat16)
        assert_same(read_all(source), expected)
        assert "PyTorch" in source.describe()

    (tmp_path / "sharded").mkdir()
    names = list(expected)
    torch.save({n: expected[n] for n in names[:3]}, tmp_path / "sharded" / "pytorch_model-00001-of-00002.bin")
    torch.save({n: expected[n] for n in names[3:]}, tmp_path / "sharded" / "pytorch_model-00002-of-00002.bin")
    weight_map = {n: f"pytorch_model-0000{1 if i < 3 else 2}-of-00002.bin" for i, n in enumerate(names)}
    (tmp_path / "sharded" / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with open_source(tmp_path / "sharded") as source:
        assert list(source.infos()) == names
        assert_same(read_all(source), expected)


def test_safetensors_loads_are_private_maps_released_when_freed(tmp_path):
    expected = {"big": torch.randn(300, 70), **tensors()}  # "big" spans pages: a map at an unaligned offset
    path = tmp_path / "w.safetensors"
    save_file(expected, path)
    before = path.read_bytes()
    source = open_source(path)
    source.infos()
    maps = Path("/proc/self/maps")

    def mapped() -> int:  # maps of the file (safe_open keeps one of its own for the header)
        return maps.read_text().count(str(path)) if maps.exists() else 0

    held = mapped()
    loaded = read_all(source)
    assert_same(loaded, expected)
    for tensor in loaded.values():  # copy on write: in-place arithmetic never reaches the file
        tensor.zero_() if tensor.dtype != torch.bool else tensor.logical_not_()
    assert path.read_bytes() == before
    assert_same(read_all(source), expected)
    rows = source.load("big", rows=(17, 230))
    assert torch.equal(rows, expected["big"][17:230])
    assert mapped() >= held + (2 if maps.exists() else 0)
    del loaded, rows, tensor
    assert mapped() == held  # the tensors' maps are gone with them


def test_safetensors_reads_fall_back_to_pread_without_memory_maps(tmp_path, monkeypatch):
    import specmerge.io.formats.safetensors_format as safetensors_format

    def no_maps(*args):
        raise OSError("no memory maps here")

    monkeypatch.setattr(safetensors_format, "mapped", no_maps)
    expected = tensors()
    save_file(expected, tmp_path / "w.safetensors")
    source = open_source(tmp_path / "w.safetensors")
    assert_same(read_all(source), expected)
    assert torch.equal(source.load("embed.weight", rows=(2, 5)), expected["embed.weight"][2:5])


def test_pytorch_loads_are_private_copies(tmp_path):
    shared = torch.arange(6.0).reshape(2, 3)
    torch.save({"embed": shared, "lm_head": shared, "row": shared[1]}, tmp_path / "tied.pt")
    source = open_source(tmp_path / "tied.pt")
    assert source.infos()["row"].shape == (3,)
    loaded = source.load("embed")
    loaded.zero_()
    assert torch.equal(source.load("lm_head"), torch.arange(6.0).reshape(2, 3))
    assert torch.equal(source.load("row"), torch.tensor([3.0, 4.0, 5.0]))


def test_legacy_pytorch_format_is_loaded_without_mmap(tmp_path):
    torch.save({"w": torch.ones(3)}, tmp_path / "old.bin", _use_new_zipfile_serialization=False)
    assert torch.equal(open_source(tmp_path / "old.bin").load("w"), torch.ones(3))


class NotATensor:
    pass


def test_pytorch_errors(tmp_path):
    torch.save({"w": NotATensor()}, tmp_path / "unsafe.bin")
    with pytest.raises(
        SourceError,
        match=r"unsafe\.bin: holds code or objects that are not tensors \(its pickle calls or builds .*NotATensor\)",
    ):
        open_source(tmp_path / "unsafe.bin").infos()
    torch.save([torch.ones(1)], tmp_path / "list.bin")
    with pytest.raises(SourceError, match=r"list\.bin: holds a list, expected a state dict"):
        open_source(tmp_path / "list.bin").infos()
    torch.save({"epoch": 3}, tmp_path / "empty.bin")
    with pytest.raises(SourceError, match=r"empty\.bin: holds no tensors"):
        open_source(tmp_path / "empty.bin").infos()
    (tmp_path / "junk.bin").write_bytes(b"not a checkpoint")
    with pytest.raises(SourceError, match=r"junk\.bin: not a readable PyTorch checkpoint"):
        open_source(tmp_path / "junk.bin").infos()


def test_missing_paths_and_empty_or_ambiguous_folders(tmp_path):
    with pytest.raises(SourceError, match=r"nope does not exist"):
        open_source(tmp_path / "nope")
    with pytest.raises(SourceError, match=r"holds no checkpoint: looked for model\.safetensors\.index\.json, "):
        open_source(tmp_path)
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(SourceError, match=r"unsupported checkpoint file"):
        open_source(tmp_path / "notes.txt")
    for name in ("a.safetensors", "b.safetensors"):
        save_file({"x": torch.zeros(1)}, tmp_path / name)
    with pytest.raises(SourceError, match=r"2 \.safetensors files \(a\.safetensors, b\.safetensors\) but no model"):
        open_source(tmp_path)
    (tmp_path / "x.safetensors.index.json").write_text("{}")
    (tmp_path / "y.safetensors.index.json").write_text("{}")
    with pytest.raises(SourceError, match=r"several safetensors indexes"):
        open_source(tmp_path)


def test_peft_adapter_folder_is_not_a_model(tmp_path):
    save_file({"x": torch.zeros(1)}, tmp_path / "adapter_model.safetensors")
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(SourceError, match=r"PEFT adapter folder"):
        open_source(tmp_path)


def test_corrupt_or_truncated_safetensors(tmp_path):
    save_file({"x": torch.arange(100.0)}, tmp_path / "good.safetensors")
    data = (tmp_path / "good.safetensors").read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(data[:-10])
    (tmp_path / "garbage.safetensors").write_bytes(b"\xff" * 8 + b"{}")
    (tmp_path / "tiny.safetensors").write_bytes(b"abc")
    for name in ("truncated", "garbage", "tiny"):
        with pytest.raises(SourceError, match=rf"{name}\.safetensors: not a valid safetensors file .* re-download"):
            open_source(tmp_path / f"{name}.safetensors").infos()


def test_unknown_dtype_in_header(tmp_path):
    header = {"x": {"dtype": "C64", "shape": [2], "data_offsets": [0, 16]}}
    write_raw_safetensors(tmp_path / "c.safetensors", header, 16)
    with pytest.raises(SourceError, match=r"c\.safetensors: tensor 'x' has dtype C64, which torch .* cannot hold"):
        open_source(tmp_path / "c.safetensors").infos()


def test_index_errors(tmp_path):
    sharded_folder(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(SourceError, match=r"shard model-00002-of-00002\.safetensors \(holding '.*'\) is missing"):
        open_source(tmp_path)

    (tmp_path / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(SourceError, match=r"model\.safetensors\.index\.json: not a valid checkpoint index"):
        open_source(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(SourceError, match=r"no 'weight_map'"):
        open_source(tmp_path)

    index = {"weight_map": {"embed.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(SourceError, match=r"maps tensor 'embed\.weight' to model-00001-of-00002\.safetensors, which"):
        open_source(tmp_path).infos()


def test_unknown_tensor_name(tmp_path):
    save_file(tensors(), tmp_path / "w.safetensors")
    source = open_source(tmp_path / "w.safetensors")
    with pytest.raises(SourceError, match=r"w\.safetensors: no tensor named 'layer\.0\.weigth'; did you mean 'layer"):
        source.load("layer.0.weigth")


def test_handles_open_lazily_and_close(tmp_path):
    sharded_folder(tmp_path)
    source = open_source(tmp_path)
    assert source._handles == {}
    source.load("mask")  # the first shard holds it, but infos open every shard's header
    assert len(source._handles) == 2
    with source:
        pass
    assert source._handles == {}
    assert source.load("mask").dtype == torch.bool  # reopened on demand
