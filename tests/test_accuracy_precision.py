"""The accuracy benchmark's precision (issue 21 item 0): bfloat16 autocast only where the CPU runs bf16 natively."""

from __future__ import annotations

import argparse

import pytest
import torch
import transformers

from specmerge_bench.accuracy import bench, precision
from specmerge_bench.accuracy import model as accuracy_model


@pytest.mark.parametrize("native, expected", [(False, "float32"), (True, "bfloat16")])
def test_auto_picks_bfloat16_only_on_a_cpu_with_native_bf16(monkeypatch, native, expected):
    monkeypatch.setattr(precision, "native_bf16", lambda: native)
    assert precision.resolve("auto") == expected
    assert precision.resolve("float32") == "float32" and precision.resolve("bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match="precision must be one of auto, bfloat16, float32"):
        precision.resolve("fp16")


X86 = "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu sse sse2 avx avx2 fma {}\nbugs\t\t: spectre_v1\n\n"
AVX512 = "avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni"  # AVX512-core: oneDNN says bf16, but emulated


@pytest.mark.parametrize(
    ("cpuinfo", "expected"),
    [
        (X86.format(f"{AVX512} avx512_bf16"), "bfloat16"),  # Cooper Lake, Zen 4
        (X86.format(f"{AVX512} amx_tile amx_bf16 amx_int8"), "bfloat16"),  # AMX
        (X86.format(AVX512), "float32"),  # Skylake/Cascade Lake server: bf16 only emulated
        (X86.format("avx512f"), "float32"),
        (X86.format(""), "float32"),  # AVX2 only
        ("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\nCPU implementer\t: 0x41\n", "bfloat16"),  # ARM, BF16
        ("processor\t: 0\nFeatures\t: fp asimd evtstrm aes crc32\n", "float32"),  # ARM without BF16
        (None, "float32"),  # no /proc/cpuinfo: another OS
    ],
)
def test_auto_reads_native_bf16_from_the_cpu_flags(monkeypatch, tmp_path, cpuinfo, expected):
    """Native means AVX512-BF16 or AMX (or ARM's BF16), not oneDNN's rule, which counts any AVX512-core CPU."""
    path = tmp_path / "cpuinfo"
    if cpuinfo is not None:
        path.write_text(cpuinfo * 2)  # one block per processor
    monkeypatch.setattr(precision, "CPUINFO", path)
    assert precision.resolve("auto") == expected
    assert precision.native_bf16() == (expected == "bfloat16")


def test_the_precision_holds_for_a_block_and_is_in_the_tag(monkeypatch):
    before = precision.current()
    with precision.using("float32") as name:
        assert name == "float32" and not precision.autocast() and precision.autocast(True)
        assert precision.tag() == f"float32-{torch.backends.cpu.get_cpu_capability()}"
    assert precision.current() == before


def test_forward_passes_follow_the_precision_in_force():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=16)  # fmt: skip
    model = transformers.BertModel(config, add_pooling_layer=False).eval()
    encoded = {"input_ids": torch.randint(0, 50, (6, 8)), "attention_mask": torch.ones(6, 8, dtype=torch.long)}
    full = accuracy_model.pooled_features(model, encoded, autocast=False)
    half = accuracy_model.pooled_features(model, encoded, autocast=True)
    assert not torch.equal(full, half)
    with precision.using("float32"):
        assert torch.equal(accuracy_model.pooled_features(model, encoded), full)
    with precision.using("bfloat16"):
        assert torch.equal(accuracy_model.pooled_features(model, encoded), half)


def test_the_command_takes_precision():
    parser = argparse.ArgumentParser()
    bench.configure(parser)
    assert parser.parse_args(["--cache", "c"]).precision == "auto"
    assert parser.parse_args(["--cache", "c", "--precision", "float32"]).precision == "float32"
    with pytest.raises(SystemExit):
        parser.parse_args(["--cache", "c", "--precision", "fp8"])
