"""Quantized checkpoints as inputs (issue 48, items 1-3): dequantized on read, exactly, or refused in one line.

Every scheme's layout is written by hand (tests/quant_models.py) from its tool's documented format; the reader must
give exactly the dense weights the stored ones stand for, and a merge of quantized experts must be the merge of
their dequantized weights. Where the format's own package is installed, its code is the reference too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from quant_models import (
    awq_quantize,
    bnb4_quantize,
    bnb8_quantize,
    ct_naive_quantize,
    ct_pack_quantize,
    dense_folder,
    fbgemm_quantize,
    fp8_block_quantize,
    gptq_quantize,
    pack_bits,
    quantize_folder,
)
from specmerge.cli import main
from specmerge.errors import SpecmergeError
from specmerge.io.formats.sources import open_source
from specmerge.io.quant.packing import unpack_int32
from specmerge.io.quant.source import QuantizedSource
from specmerge.pipeline.run.api import merge
from test_safety_inputs import cli_error
from tiny_models import build_family

FAST = {"progress": False, "fsync": False}


def ct_config(fmt: str, **weights) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
        "ignore": ["lm_head"],
    }


BNB4 = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
SCHEMES = {
    "fp8-block": (
        lambda w: fp8_block_quantize(w, (16, 24)),  # 24 does not divide 32 or 48: partial blocks
        {"quant_method": "fp8", "weight_block_size": [16, 24], "activation_scheme": "dynamic", "fmt": "e4m3"},
    ),
    "fp8-block-ue8m0": (
        lambda w: fp8_block_quantize(w, (16, 16), ue8m0=True),
        {"quant_method": "fp8", "weight_block_size": [16, 16], "scale_fmt": "ue8m0"},
    ),
    "fp8-tensor": (lambda w: fp8_block_quantize(w, None), {"quant_method": "fp8", "weight_block_size": None}),
    "fbgemm-fp8": (fbgemm_quantize, {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0}),
    "ct-w4a16": (
        lambda w: ct_pack_quantize(w, 4, 16, symmetric=True),
        ct_config("pack-quantized", num_bits=4, type="int", symmetric=True, strategy="group", group_size=16),
    ),
    "ct-w4-asym": (
        lambda w: ct_pack_quantize(w, 4, 16, symmetric=False),
        ct_config("pack-quantized", num_bits=4, type="int", symmetric=False, strategy="group", group_size=16),
    ),
    "ct-w8-channel": (
        lambda w: ct_pack_quantize(w, 8, None, symmetric=True),
        ct_config("pack-quantized", num_bits=8, type="int", symmetric=True, strategy="channel"),
    ),
    "ct-fp8": (
        lambda w: ct_naive_quantize(w, "float"),
        ct_config("float-quantized", num_bits=8, type="float", symmetric=True, strategy="channel"),
    ),
    "ct-int8": (
        lambda w: ct_naive_quantize(w, "int"),
        ct_config("int-quantized", num_bits=8, type="int", symmetric=True, strategy="channel"),
    ),
    "gptq-v1-act-order": (
        lambda w: gptq_quantize(w, 4, 16, act_order=True, v1=True),
        {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": True, "sym": False},
    ),
    "gptq-v2-8bit": (
        lambda w: gptq_quantize(w, 8, 16, act_order=False, v1=False),
        {"quant_method": "gptq", "bits": 8, "group_size": 16, "checkpoint_format": "gptq_v2"},
    ),
    "gptq-2bit": (
        lambda w: gptq_quantize(w, 2, 16, act_order=False, v1=True),
        {"quant_method": "gptq", "bits": 2, "group_size": 16, "desc_act": False},
    ),
    "bnb-nf4-nested": (lambda w: bnb4_quantize(w, 64, nested=True), {**BNB4, "bnb_4bit_use_double_quant": True}),
    "bnb-nf4": (lambda w: bnb4_quantize(w, 64, nested=False), BNB4),
    "bnb-int8": (bnb8_quantize, {"quant_method": "bitsandbytes", "load_in_8bit": True}),
    "awq-gemm": (
        lambda w: awq_quantize(w, 16),
        {"quant_method": "awq", "bits": 4, "group_size": 16, "version": "gemm", "zero_point": True},
    ),
}


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> tuple[Path, list[Path]]:
    return build_family(tmp_path_factory.mktemp("quant"), "llama", n_experts=2)


def quantized(family, tmp_path: Path, scheme: str, which: str = "expert0") -> tuple[Path, dict]:
    base, experts = family
    src = {"base": base, "expert0": experts[0], "expert1": experts[1]}[which]
    quantize, config = SCHEMES[scheme]
    folder = tmp_path / f"{which}-{scheme}"
    return folder, quantize_folder(src, folder, quantize, config)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_weight_reads_as_the_dense_weight_its_codes_stand_for(family, tmp_path, scheme):
    folder, dense = quantized(family, tmp_path, scheme)
    with open_source(folder) as source:
        assert isinstance(source, QuantizedSource)
        infos = source.infos()
        assert sorted(infos) == sorted(dense)  # the dense model's names, nothing else
        for name, expected in dense.items():
            got = source.load(name)
            assert tuple(infos[name].shape) == tuple(expected.shape)
            # the same float32 products as the documented formula, element by element: exactly equal
            torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=0, msg=name)
        weight = "model.layers.1.mlp.down_proj.weight"
        rows = source.load(weight, (5, 21))  # a block of rows crossing scale blocks and groups
        torch.testing.assert_close(rows, source.load(weight)[5:21], rtol=0, atol=0)
        assert source.summary()["dequantized"] == 14  # 7 projections in each of 2 layers


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("method", ["task_arithmetic", "swudi_a"])
def test_merging_quantized_experts_is_merging_their_dequantized_weights(family, tmp_path, scheme, method):
    """The two silent defects of issue 48 (FP8 codes and scales merged as weights; GPTQ codes kept from the base
    with averaged scales) are this test for fp8-block and gptq."""
    base, _ = family
    folders, dense_copies = [], []
    for which in ("expert0", "expert1"):
        folder, dense = quantized(family, tmp_path, scheme, which)
        folders.append(folder)
        dense_copies.append(dense_folder(folder, tmp_path / f"{which}-dense", dense))
    got_report = merge(base, folders, tmp_path / "from-quantized", method=method, dtype="float32", **FAST)
    merge(base, dense_copies, tmp_path / "from-dense", method=method, dtype="float32", **FAST)
    got = load_file(tmp_path / "from-quantized" / "model.safetensors")
    want = load_file(tmp_path / "from-dense" / "model.safetensors")
    assert got.keys() == want.keys()
    for name in want:
        # the same float32 inputs through the same code path: the same bits
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
    quant = [note for note in got_report["inputs"] if note.get("quantization")]
    assert len(quant) == 2 and quant[0]["quantization"]["dequantized"] == 14


def test_a_quantized_base_gives_a_dense_model_transformers_loads(family, tmp_path):
    """Base and experts in different schemes; the output is dense, its config states no quantization."""
    base_q, _ = quantized(family, tmp_path, "fp8-block", "base")
    expert_a, _ = quantized(family, tmp_path, "gptq-v1-act-order", "expert0")
    _, experts = family
    out = tmp_path / "merged"
    merge(base_q, [expert_a, experts[1]], out, method="swudi_a", **FAST)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    stored = load_file(out / "model.safetensors")
    # a dequantized weight is written in the dtype the base was quantized from (its config.json's torch_dtype)
    stated = json.loads((base_q / "config.json").read_text())
    assert stated.get("torch_dtype", stated.get("dtype")) == "float32"
    assert stored["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32
    assert not [n for n in stored if n.endswith(("qweight", "weight_scale_inv", "scales", "qzeros"))]
    _model, info = transformers.LlamaForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_the_packing_is_compressed_tensors_own(tmp_path):
    """Our unpacking inverts compressed-tensors' packer (the reference), at every bit width it packs."""
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    g = torch.Generator().manual_seed(0)
    for bits in range(1, 9):
        signed = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (5, 37), generator=g, dtype=torch.int8)
        packed = helpers.pack_to_int32(signed, bits)
        assert torch.equal(packed, pack_bits(signed.to(torch.int32) + 2 ** (bits - 1), bits))
        got = unpack_int32(packed, bits, 37, dim=1) - 2 ** (bits - 1)
        assert torch.equal(got.to(torch.int8), signed)


def test_fp8_blocks_match_transformers_dequantizer():
    """transformers' own FP8 dequantizer (where this transformers has it) gives our values."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    reference = getattr(fp8, "_dequantize_fp8_weight", None)
    if reference is None:
        pytest.skip("this transformers has no _dequantize_fp8_weight")
    from specmerge.io.quant.fp8 import scaled_blocks

    w = torch.randn(40, 56, generator=torch.Generator().manual_seed(1))
    stored, dense = fp8_block_quantize(w, (16, 24))
    want = reference(stored["weight"], stored["weight_scale_inv"], [16, 24], torch.float32)
    torch.testing.assert_close(scaled_blocks(stored["weight"], stored["weight_scale_inv"], (16, 24)), want)
    torch.testing.assert_close(dense, want)


# --- refused, in one line, before any work ------------------------------------------------------------------


def edit(folder: Path, *, config=None, tensors=None) -> Path:
    """Change a quantized folder in place: ``config(dict)`` edits config.json, ``tensors(dict)`` the weights."""
    if config is not None:
        cfg = json.loads((folder / "config.json").read_text())
        config(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        state = load_file(folder / "model.safetensors")
        tensors(state)
        save_file(state, folder / "model.safetensors")
    return folder


W = "model.layers.0.self_attn.q_proj"
HOSTILE = {
    "unknown-method": ("fp8-block", {"config": lambda c: c["quantization_config"].update(quant_method="hqq")}, "'hqq'"),
    "config-says-bitsandbytes": (
        "fp8-block",
        {"config": lambda c: c.update(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})},
        "which the scheme does not account for (bitsandbytes)",
    ),
    "torchao": (
        "fp8-block",
        {"config": lambda c: c["quantization_config"].update(quant_method="torchao")},
        "'torchao'",
    ),
    "no-config": ("fp8-block", {"config": lambda c: c.pop("quantization_config")}, "no quantization_config"),
    "config-disagrees": (
        "fp8-block",
        {"config": lambda c: c.update(quantization_config=SCHEMES["gptq-2bit"][1])},
        "fp8",
    ),
    "scale-wrong-shape": (
        "fp8-block",
        {"tensors": lambda s: s.update({f"{W}.weight_scale_inv": torch.ones(1, 2)})},
        "weight_scale_inv' has shape (1, 2)",
    ),
    "truncated-codes": (
        "gptq-v1-act-order",
        {"tensors": lambda s: s.update({f"{W}.qweight": s[f"{W}.qweight"][:2].contiguous()})},
        "qweight' has 2 rows",
    ),
    "nan-scale": (
        "fp8-block",
        {"tensors": lambda s: s[f"{W}.weight_scale_inv"].__setitem__((0, 0), float("nan"))},
        "NaN or infinite scales",
    ),
    "inf-scale": (
        "awq-gemm",
        {"tensors": lambda s: s[f"{W}.scales"].__setitem__((0, 0), float("inf"))},
        "NaN or infinite",
    ),
    "g_idx-out-of-range": (
        "gptq-v1-act-order",
        {"tensors": lambda s: s[f"{W}.g_idx"].__setitem__(0, 99)},
        "names groups outside",
    ),
    "stray-scale": ("gptq-2bit", {"tensors": lambda s: s.pop(f"{W}.qweight")}, "has no"),
    "unread-format": (
        "ct-w4a16",
        {"config": lambda c: c["quantization_config"].update(format="nvfp4-pack-quantized")},
        "nvfp4-pack-quantized",
    ),
    "gptq-3bit": ("gptq-2bit", {"config": lambda c: c["quantization_config"].update(bits=3)}, "bits 3"),
    "awq-gemv": ("awq-gemm", {"config": lambda c: c["quantization_config"].update(version="gemv")}, "gemv"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_quantized_checkpoint_that_cannot_be_read_exactly_is_refused(family, tmp_path, capsys, case):
    scheme, change, expected = HOSTILE[case]
    folder, _ = quantized(family, tmp_path, scheme)
    edit(folder, **change)
    base, experts = family
    out = tmp_path / "out"
    err = cli_error(["merge", str(base), str(folder), str(experts[1]), "-o", str(out), "-q", "-m", "swudi_a"], capsys)
    assert str(folder) in err and expected in err, err
    assert not out.exists() and not list(tmp_path.glob(".specmerge-*"))


def test_fp8_tensors_in_a_single_file_without_config_are_refused(family, tmp_path, capsys):
    folder, _ = quantized(family, tmp_path, "fp8-block")
    base, _experts = family
    single = folder / "model.safetensors"
    err = cli_error(["merge", str(base / "model.safetensors"), str(single), "-o", str(tmp_path / "o"), "-q"], capsys)
    assert "weight_scale_inv" in err or "fp8" in err, err


def test_unpacking_straddling_codes():
    """Codes of 3, 5, 6 and 7 bits cross word boundaries; each comes back."""
    g = torch.Generator().manual_seed(3)
    for bits in (1, 2, 3, 4, 5, 6, 7, 8):
        codes = torch.randint(0, 2**bits, (3, 45), generator=g, dtype=torch.int32)
        packed = pack_bits(codes, bits)
        assert packed.shape == (3, math.ceil(45 * bits / 32))
        assert torch.equal(unpack_int32(packed, bits, 45, dim=1), codes)
        assert torch.equal(unpack_int32(packed.T.contiguous(), bits, 45, dim=0), codes.T)


# --- written quantized: --quantize fp8-block / same (item 3) -------------------------------------------------


def test_quantize_fp8_block_writes_what_transformers_loads_with_the_error_reported(family, tmp_path, capsys):
    base, experts = family
    dense_out, fp8_out = tmp_path / "dense", tmp_path / "fp8"
    merge(base, experts, dense_out, method="swudi_a", **FAST)
    capsys.readouterr()
    args = ["merge", str(base), *map(str, experts), "-o", str(fp8_out), "-m", "swudi_a", "--quantize", "fp8-block"]
    assert main(args) == 0
    assert "weights in fp8 (fp8-block): largest relative error" in capsys.readouterr().err
    config = json.loads((fp8_out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert config["quantization_config"]["modules_to_not_convert"] == ["lm_head", "model.embed_tokens"]
    stored, dense = load_file(fp8_out / "model.safetensors"), load_file(dense_out / "model.safetensors")
    report = json.loads((fp8_out / "report.json").read_text())["quantization"]
    assert report["weights"] == 14 and set(report["relative_error"]) == {n for n in dense if "_proj" in n}
    for name, error in report["relative_error"].items():
        assert stored[name].dtype == torch.float8_e4m3fn
        back = stored[name].float() * stored[name.replace(".weight", ".weight_scale_inv")]  # one 128 x 128 block
        measured = float((back - dense[name].float()).norm() / dense[name].float().norm())
        assert measured == pytest.approx(error, rel=1e-6) and 0 < error < 2**-4  # e4m3: 3 mantissa bits
    assert report["largest"]["relative_error"] == max(report["relative_error"].values())
    # specmerge reads its own output back as the dense model it stands for
    with open_source(fp8_out) as source:
        assert isinstance(source, QuantizedSource) and source.summary()["dequantized"] == 14
    # and so does transformers (on a CPU it dequantizes FP8 checkpoints as it loads them)
    pytest.importorskip("accelerate")
    model = transformers.LlamaForCausalLM.from_pretrained(fp8_out, dtype=torch.float32)
    weight = model.get_parameter("model.layers.0.self_attn.q_proj.weight")
    name = "model.layers.0.self_attn.q_proj.weight"
    want = stored[name].float() * stored[name.replace(".weight", ".weight_scale_inv")]
    torch.testing.assert_close(weight.float(), want, rtol=2**-8, atol=0)  # transformers dequantizes to bfloat16


def test_quantize_same_writes_the_base_scheme_for_the_weights_it_quantized(family, tmp_path):
    base_q, _ = quantized(family, tmp_path, "fp8-block", "base")
    _, experts = family
    merge(base_q, experts, tmp_path / "out", method="task_arithmetic", quantize="same", **FAST)
    written = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert written == SCHEMES["fp8-block"][1]  # the base's, 16 x 24 blocks
    stored = load_file(tmp_path / "out" / "model.safetensors")
    assert stored["model.layers.1.mlp.down_proj.weight_scale_inv"].shape == (2, 2)  # 32 x 48 in 16 x 24 blocks
    assert stored["lm_head.weight"].dtype == torch.float32


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"quantize": "same"}, "quantize same writes the base's FP8 scheme"),
        ({"quantize": "fp8-block", "output_format": "lora"}, "quantize applies to a merged model"),
    ],
)
def test_quantized_outputs_that_cannot_be_written_are_refused(family, tmp_path, options, expected):
    base, experts = family
    with pytest.raises(SpecmergeError, match=expected):
        merge(base, experts, tmp_path / "out", method="task_arithmetic", **options, **FAST)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [True, False])
def test_bitsandbytes_4bit_reads_as_its_reference_dequantizer(quant_type, nested):
    """Where bitsandbytes is installed (not in CI: 125 MB), its own quantizer's output, serialized as transformers
    does, reads as its pure-PyTorch reference dequantizer gives it (the layout of its CUDA kernels). Checked here
    with bitsandbytes 0.50.2. (Its CPU C kernel disagrees with that reference on even widths; it is not the
    reference.)"""
    functional = pytest.importorskip("bitsandbytes.functional")
    default = pytest.importorskip("bitsandbytes.backends.default.ops")
    utils = pytest.importorskip("bitsandbytes.backends.utils")
    from specmerge.io.formats.protocol import TensorInfo
    from specmerge.io.quant.bnb import Bitsandbytes

    for shape in ((96, 80), (37, 53)):
        w = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
        q, state = functional.quantize_4bit(w, blocksize=64, compress_statistics=nested, quant_type=quant_type)
        tensors = {"m.weight": q, **{f"m.weight.{k}": v for k, v in state.as_dict(packed=True).items()}}
        infos = {k: TensorInfo(k, tuple(v.shape), v.dtype) for k, v in tensors.items()}

        def read(name, rows, tensors=tensors):
            return tensors[name] if rows is None else tensors[name][rows[0] : rows[1]]

        scheme = Bitsandbytes("check")
        (packed,) = scheme.packed(infos, read)
        absmax = state.absmax
        if nested:
            s2 = state.state2
            absmax = default._dequantize_blockwise_compute(
                absmax.reshape(-1), s2.absmax, s2.code, s2.blocksize, torch.float32
            )
            absmax = absmax + state.offset
        code = utils._get_4bit_code(quant_type, q.device)
        want = default._dequantize_4bit_compute(q.reshape(-1), absmax, code, 64, shape, torch.float32)
        torch.testing.assert_close(scheme.dequantize(packed, read, None), want, rtol=0, atol=0)
