"""GGUF files as experts (issue 48, item 1): read in the base's names, q/k rows un-permuted, every type dequantized
as the gguf package (llama.cpp's reference) does; a broken or lying file refused in one line; fuzzed."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from quant_models import dense_folder
from specmerge.errors import SpecmergeError
from specmerge.io.formats.gguf_format import open_gguf
from specmerge.io.formats.protocol import TensorInfo
from specmerge.pipeline.run.api import merge
from test_safety_inputs import cli_error
from tiny_models import build_family

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
HEADS, KV_HEADS = 4, 2  # tiny_models.llama_config
FAST = {"progress": False, "fsync": False}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def qtype_for(name: str, shape: tuple[int, ...]) -> T:
    if len(shape) == 1:
        return T.F32
    if "down_proj" in name:
        return T.F16  # 48 inputs: not a multiple of Q8_0's 32-value blocks
    return {"q_proj": T.Q8_0, "k_proj": T.Q4_0, "v_proj": T.BF16}.get(name.split(".")[-2], T.Q8_0)


def write_gguf(state: dict[str, torch.Tensor], path: Path, layers: int = 2) -> dict[str, torch.Tensor]:
    """``state`` (a tiny Llama's) as llama.cpp writes it; the dense tensors the file stands for, by HF name."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    dense = {}
    for name, value in state.items():
        data = value.float().numpy()
        qtype = qtype_for(name, data.shape)
        if name.endswith("q_proj.weight"):
            data = permute(data, HEADS)
        elif name.endswith("k_proj.weight"):
            data = permute(data, KV_HEADS)
        stored = (
            data if qtype == T.F32 else data.astype(np.float16) if qtype == T.F16 else gguf.quants.quantize(data, qtype)
        )
        writer.add_tensor(
            table.get_name(name, try_suffixes=(".weight",)),
            stored,
            raw_dtype=None if qtype in (T.F32, T.F16) else qtype,
        )
        back = gguf.quants.dequantize(stored, qtype).reshape(data.shape)
        if name.endswith("q_proj.weight"):
            back = permute_back(back, HEADS)
        elif name.endswith("k_proj.weight"):
            back = permute_back(back, KV_HEADS)
        dense[name] = torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dense


def permute_back(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    base, experts = build_family(root, "llama", n_experts=2)
    state = load_file(experts[0] / "model.safetensors")
    dense = write_gguf(state, root / "expert0.gguf")
    return base, experts, root / "expert0.gguf", dense


def test_a_gguf_expert_reads_in_the_base_names_with_q_and_k_unpermuted(family):
    base, experts, path, dense = family
    base_infos = {k: TensorInfo(k, tuple(v.shape), v.dtype) for k, v in load_file(base / "model.safetensors").items()}
    original = load_file(experts[0] / "model.safetensors")
    with open_gguf(path, base_infos) as source:
        assert sorted(source.infos()) == sorted(original)
        for name, want in dense.items():
            got = source.load(name).float()
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
            # and the dequantized values are the original weights up to the type's rounding (so the rows are in order)
            scale = float(original[name].abs().max())
            assert float((got - original[name]).abs().max()) <= 0.15 * scale, name
        q = "model.layers.1.self_attn.q_proj.weight"
        torch.testing.assert_close(source.load(q, (3, 9)).float(), dense[q][3:9], rtol=0, atol=0)


@pytest.mark.parametrize("method", ["swudi_a", "task_arithmetic"])
def test_merging_a_gguf_expert_is_merging_its_dequantized_weights(family, tmp_path, method):
    base, experts, path, dense = family
    dense_copy = dense_folder(experts[0], tmp_path / "dense0", dense)
    merge(base, [path, experts[1]], tmp_path / "a", method=method, dtype="float32", **FAST)
    merge(base, [dense_copy, experts[1]], tmp_path / "b", method=method, dtype="float32", **FAST)
    got, want = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quants_read_as_the_gguf_package_dequantizes_them(tmp_path, qtype):
    """K-quant super-blocks of 256 values (the gguf package has no K-quant quantizer: the blocks are random bytes
    with finite scales), in a down_proj of 4 x 256."""
    kind = getattr(T, qtype)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(4, 256 // block * size), dtype=np.uint8)
    scales = np.full((4, 1), 0.01, dtype=np.float16).view(np.uint8)
    d_at = {"Q6_K": size - 2, "Q4_K": 0, "Q5_K": 0}[qtype]  # where the fp16 super-block scale d sits
    raw[:, d_at : d_at + 2] = scales
    if qtype in ("Q4_K", "Q5_K"):
        raw[:, 2:4] = scales  # dmin
    path = tmp_path / "k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_head_count(2)
    writer.add_tensor("blk.0.ffn_down.weight", raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    name = "model.layers.0.mlp.down_proj.weight"
    with open_gguf(path, {name: TensorInfo(name, (4, 256), torch.float32)}) as source:
        got = source.load(name)
    want = torch.from_numpy(gguf.quants.dequantize(raw, kind))
    assert got.shape == (4, 256) and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_gguf_base_a_truncated_file_and_a_stranger_are_refused(family, tmp_path, capsys):
    base, experts, path, _ = family
    err = cli_error(["merge", str(path), *map(str, experts), "-o", str(tmp_path / "o"), "-q"], capsys)
    assert "a GGUF file is read as an expert only" in err
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size - 100])
    err = cli_error(["merge", str(base), str(cut), str(experts[1]), "-o", str(tmp_path / "o"), "-q"], capsys)
    assert str(cut) in err and ("lies past the file's end" in err or "not a valid GGUF file" in err), err
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\xff" * 64)
    err = cli_error(["merge", str(base), str(junk), str(experts[1]), "-o", str(tmp_path / "o"), "-q"], capsys)
    assert "not a valid GGUF file" in err
    assert not (tmp_path / "o").exists()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_fuzzed_gguf_files_load_or_fail_in_one_line(family, data):
    """Bytes of a valid GGUF file flipped or cut anywhere: reading every tensor either works or raises a one-line
    SpecmergeError, never another exception."""
    base, _, path, _ = family
    raw = bytearray(path.read_bytes())
    base_infos = {k: TensorInfo(k, tuple(v.shape), v.dtype) for k, v in load_file(base / "model.safetensors").items()}
    for _ in range(data.draw(st.integers(1, 4))):
        where = data.draw(st.integers(0, len(raw) - 1))
        raw[where] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    with tempfile.TemporaryDirectory() as tmp:
        fuzzed = Path(tmp) / "f.gguf"
        fuzzed.write_bytes(bytes(raw))
        try:
            with open_gguf(fuzzed, base_infos) as source:
                for name in source.infos():
                    source.load(name)
        except SpecmergeError as err:
            assert "\n" not in str(err)
