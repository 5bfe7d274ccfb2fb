"""Quantized checkpoints written by hand in the layouts their tools publish, for the quantized-input tests.

Each ``*_quantize`` function quantizes a dense ``[out, in]`` weight into the stored tensors of one scheme and
returns them with the dense weight those tensors stand for (its dequantization by the scheme's documented formula,
computed here element by element in the plainest way, independent of specmerge's reader). :func:`quantize_folder`
turns a saved model folder into a quantized one: every 2-D linear weight of the decoder layers quantized, the
scheme stated in config.json.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0  # largest float8_e4m3fn


def fp8_block_quantize(
    w: torch.Tensor, block: tuple[int, int] | None, *, ue8m0: bool = False
) -> tuple[dict, torch.Tensor]:
    """``weight`` (float8_e4m3fn) and ``weight_scale_inv`` (float32, one per block, or one number for None; with
    ``ue8m0`` a power of two stored as float8_e8m0fnu, as DeepSeek's ``scale_fmt: ue8m0`` checkpoints)."""
    rows, cols = w.shape
    bo, bi = block or (rows, cols)
    nr, nc = math.ceil(rows / bo), math.ceil(cols / bi)
    scale = torch.empty(nr, nc)
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    dense = torch.empty(rows, cols)
    for r in range(nr):
        for c in range(nc):
            tile = w[r * bo : (r + 1) * bo, c * bi : (c + 1) * bi]
            s = float(tile.abs().max()) / FP8_MAX or 1.0
            if ue8m0:
                s = 2.0 ** math.ceil(math.log2(s))
            q = (tile / s).to(torch.float8_e4m3fn)
            scale[r, c] = s
            codes[r * bo : (r + 1) * bo, c * bi : (c + 1) * bi] = q
            dense[r * bo : (r + 1) * bo, c * bi : (c + 1) * bi] = q.float() * torch.tensor(s, dtype=torch.float32)
    scale = scale.to(torch.float8_e8m0fnu) if ue8m0 else scale
    return {"weight": codes, "weight_scale_inv": scale if block else scale.reshape(())}, dense


def fbgemm_quantize(w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """``weight`` (float8_e4m3fn) and ``weight_scale`` ``[out, 1]``."""
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-8)
    codes = (w / scale).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale": scale}, codes.float() * scale


def int_codes(
    w: torch.Tensor, bits: int, group: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Integer codes (unsigned, 0 .. 2**bits-1), scale and zero point per (row, group of ``group`` columns)."""
    rows, cols = w.shape
    groups = math.ceil(cols / group)
    top = 2**bits - 1
    scale, zero = torch.empty(rows, groups), torch.empty(rows, groups)
    codes = torch.empty(rows, cols, dtype=torch.int32)
    for g in range(groups):
        tile = w[:, g * group : (g + 1) * group]
        if symmetric:
            s = (tile.abs().amax(dim=1) / (top / 2)).clamp(min=1e-8)
            z = torch.full((rows,), float(2 ** (bits - 1)))
        else:
            lo, hi = tile.amin(dim=1), tile.amax(dim=1)
            s = ((hi - lo) / top).clamp(min=1e-8)
            z = torch.round(-lo / s).clamp(0, top)
        codes[:, g * group : (g + 1) * group] = (
            torch.round(tile / s[:, None] + z[:, None]).clamp(0, top).to(torch.int32)
        )
        scale[:, g], zero[:, g] = s, z
    return codes, scale, zero


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ``bits``-bit codes packed along the last dim: code i at bit i*bits of the row's run of int32 words."""
    rows, cols = codes.shape
    words = math.ceil(cols * bits / 32)
    out = [[0] * words for _ in range(rows)]
    for r in range(rows):
        for i in range(cols):
            value, start = int(codes[r, i]), i * bits
            for b in range(bits):
                if value >> b & 1:
                    bit = start + b
                    out[r][bit // 32] |= 1 << (bit % 32)
    as_signed = [[v - (1 << 32) if v >= 1 << 31 else v for v in row] for row in out]
    return torch.tensor(as_signed, dtype=torch.int32).reshape(rows, words)


def ct_pack_quantize(w: torch.Tensor, bits: int, group: int | None, symmetric: bool) -> tuple[dict, torch.Tensor]:
    """compressed-tensors ``pack-quantized``: ``weight_packed``, ``weight_shape``, ``weight_scale`` (and a packed
    ``weight_zero_point`` when asymmetric); ``group`` None is per output channel."""
    rows, cols = w.shape
    codes, scale, zero = int_codes(w, bits, group or cols, symmetric)
    2 ** (bits - 1)
    tensors = {
        "weight_packed": pack_bits(codes, bits),
        "weight_shape": torch.tensor([rows, cols]),
        "weight_scale": scale,
    }
    groups = torch.arange(cols) // (group or cols)
    dense = (codes.float() - zero[:, groups]) * scale[:, groups]
    if not symmetric:  # stored signed (minus the offset) and packed along the output dim
        tensors["weight_zero_point"] = pack_bits(zero.to(torch.int32).T, bits).T.contiguous()
    return tensors, dense


def ct_naive_quantize(w: torch.Tensor, kind: str) -> tuple[dict, torch.Tensor]:
    """compressed-tensors ``float-quantized`` (fp8, per channel) or ``int-quantized`` (int8, per channel)."""
    if kind == "float":
        tensors, dense = fbgemm_quantize(w)
        return {"weight": tensors["weight"], "weight_scale": tensors["weight_scale"]}, dense
    scale = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-8)
    codes = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    return {"weight": codes, "weight_scale": scale}, codes.float() * scale


def gptq_quantize(w: torch.Tensor, bits: int, group: int, *, act_order: bool, v1: bool) -> tuple[dict, torch.Tensor]:
    """GPTQ: ``qweight`` [in*bits/32, out], ``qzeros`` [groups, out*bits/32], ``scales`` [groups, out] (float16),
    ``g_idx`` [in]; with ``act_order`` the input rows' groups are a permutation; ``v1`` stores zeros minus one."""
    out_f, in_f = w.shape
    wt = w.T.contiguous()  # [in, out]
    groups = math.ceil(in_f / group)
    g_idx = torch.arange(in_f) // group
    if act_order:
        g_idx = g_idx[torch.randperm(in_f, generator=torch.Generator().manual_seed(in_f))]
    top = 2**bits - 1
    scale, zero = torch.empty(groups, out_f), torch.empty(groups, out_f, dtype=torch.int32)
    codes = torch.empty(in_f, out_f, dtype=torch.int32)
    for g in range(groups):
        rows = (g_idx == g).nonzero().flatten()
        tile = wt[rows]
        lo, hi = tile.amin(dim=0), tile.amax(dim=0)
        s = ((hi - lo) / top).clamp(min=1e-4).half().float()
        z = torch.round(-lo / s).clamp(1, top).to(torch.int32)
        codes[rows] = torch.round(tile / s + z).clamp(0, top).to(torch.int32)
        scale[g], zero[g] = s, z
    dense = ((codes.float() - zero[g_idx].float()) * scale[g_idx]).T.contiguous()
    stored_zero = zero - 1 if v1 else zero
    tensors = {
        "qweight": pack_bits(codes.T.contiguous(), bits).T.contiguous(),
        "qzeros": pack_bits(stored_zero, bits),
        "scales": scale.half(),
        "g_idx": g_idx.to(torch.int32),
    }
    return tensors, dense


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def awq_pack(codes: torch.Tensor) -> torch.Tensor:
    """AutoAWQ GEMM packing of [rows, cols] 4-bit codes: word c's nibble i holds column c*8 + AWQ_ORDER[i]."""
    reordered = codes.reshape(codes.shape[0], -1, 8)[:, :, list(AWQ_ORDER)].reshape(codes.shape)
    return pack_bits(reordered, 4)


def awq_quantize(w: torch.Tensor, group: int) -> tuple[dict, torch.Tensor]:
    """AWQ GEMM: ``qweight`` [in, out/8], ``qzeros`` [groups, out/8], ``scales`` [groups, out] (float16)."""
    codes, scale, zero = int_codes(w, 4, group, symmetric=False)  # per (output row, group of input columns)
    scale = scale.half().float()
    g = torch.arange(w.shape[1]) // group
    dense = (codes.float() - zero[:, g]) * scale[:, g]
    tensors = {
        "qweight": awq_pack(codes.T.contiguous()),
        "qzeros": awq_pack(zero.T.contiguous().to(torch.int32)),
        "scales": scale.T.contiguous().half(),
    }
    return tensors, dense


def is_quantized_linear(name: str, value: torch.Tensor) -> bool:
    """The weights :func:`quantize_folder` quantizes: 2-D weights inside the decoder layers."""
    return ".layers." in name and name.endswith("_proj.weight") and value.dim() == 2


def quantize_folder(src: Path, dst: Path, quantize, config: dict) -> dict[str, torch.Tensor]:
    """Copy the model folder ``src`` to ``dst`` with every :func:`is_quantized_linear` weight replaced by what
    ``quantize(weight)`` stores (``<module>.<part>`` for each part), config.json's ``quantization_config`` set to
    ``config``; returns the dense weights the stored ones stand for, by tensor name (the others as they are)."""
    shutil.copytree(src, dst)
    state = load_file(src / "model.safetensors")
    stored, dense = {}, {}
    for name, value in state.items():
        if not is_quantized_linear(name, value):
            stored[name] = dense[name] = value
            continue
        module = name[: -len(".weight")]
        parts, dense[name] = quantize(value.float())
        for part, tensor in parts.items():
            stored[f"{module}.{part}"] = tensor.contiguous()
    save_file(stored, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = config
    (dst / "config.json").write_text(json.dumps(cfg))
    return dense


def dense_folder(src: Path, dst: Path, dense: dict[str, torch.Tensor]) -> Path:
    """``src``'s folder with its weights replaced by ``dense`` (float32) and no quantization_config."""
    shutil.copytree(src, dst)
    save_file({k: v.float().contiguous() if v.is_floating_point() else v for k, v in dense.items()},
              dst / "model.safetensors", metadata={"format": "pt"})  # fmt: skip
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_quantize(stack: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """gpt-oss MXFP4 of an expert stack ``[E, in, out]``: ``_blocks`` uint8 [E, out, in/32, 16] (the low nibble holds
    the even input) and ``_scales`` uint8 [E, out, in/32] (2**(s-127) per group of 32 inputs of an output row)."""
    experts, fan_in, fan_out = stack.shape
    rows = stack.transpose(1, 2).reshape(experts, fan_out, fan_in // 32, 32)  # one output row's groups of 32
    table = torch.tensor(E2M1)
    amax = rows.abs().amax(dim=-1).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = rows / torch.pow(2.0, exponent).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - table).abs().argmin(dim=-1)  # the nearest E2M1 value's code
    dense = table[codes] * torch.pow(2.0, exponent).unsqueeze(-1)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    tensors = {"_blocks": blocks.contiguous(), "_scales": (exponent + 127).to(torch.uint8)}
    return tensors, dense.reshape(experts, fan_out, fan_in).transpose(1, 2).contiguous()


def mxfp4_folder(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """``src`` (a gpt-oss folder) with every expert stack stored as MXFP4, config stating ``quant_method: mxfp4``;
    the dense tensors the stored ones stand for."""
    shutil.copytree(src, dst)
    state = load_file(src / "model.safetensors")
    stored, dense = {}, {}
    for name, value in state.items():
        if not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            stored[name] = dense[name] = value
            continue
        parts, dense[name] = mxfp4_quantize(value.float())
        for suffix, tensor in parts.items():
            stored[name + suffix] = tensor
    save_file(stored, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dense


NF4 = (  # bitsandbytes' NF4 code: the 16 values a 4-bit code stands for
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)  # fmt: skip


def nearest(values: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return (values.unsqueeze(-1) - table).abs().argmin(dim=-1)


def bnb4_quantize(w: torch.Tensor, blocksize: int = 64, nested: bool = True) -> tuple[dict, torch.Tensor]:
    """bitsandbytes nf4 as transformers serializes it: the codes two a byte (high nibble first), absmax per block
    (with ``nested``, themselves 8-bit codes of a 256-value map per 256 blocks, around their mean)."""
    rows, cols = w.shape
    flat, count = w.reshape(-1).float(), w.numel()
    blocks = math.ceil(count / blocksize)
    padded = torch.nn.functional.pad(flat, (0, blocks * blocksize - count)).reshape(blocks, blocksize)
    absmax = padded.abs().amax(dim=1).clamp(min=1e-8)
    table = torch.tensor(NF4)
    codes = nearest(padded / absmax.unsqueeze(1), table).reshape(-1)[:count]
    state = {"quant_type": "nf4", "blocksize": blocksize, "dtype": "float32", "shape": [rows, cols]}
    tensors = {"weight.quant_map": table}
    if nested:
        offset = float(absmax.mean())
        centered = absmax - offset
        groups = math.ceil(blocks / 256)
        grid = torch.nn.functional.pad(centered, (0, groups * 256 - blocks)).reshape(groups, 256)
        nested_absmax = grid.abs().amax(dim=1).clamp(min=1e-12)
        nested_map = torch.linspace(-1.0, 1.0, 256)
        absmax_codes = nearest(grid / nested_absmax.unsqueeze(1), nested_map).reshape(-1)[:blocks]
        absmax = (nested_map[absmax_codes].reshape(-1) * nested_absmax.repeat_interleave(256)[:blocks]) + offset
        tensors |= {
            "weight.absmax": absmax_codes.to(torch.uint8),
            "weight.nested_absmax": nested_absmax,
            "weight.nested_quant_map": nested_map,
        }
        state |= {"nested_blocksize": 256, "nested_offset": offset, "nested_dtype": "float32"}
    else:
        tensors["weight.absmax"] = absmax
    dense = (table[codes] * absmax.repeat_interleave(blocksize)[:count]).reshape(rows, cols)
    padded_codes = torch.nn.functional.pad(codes, (0, count % 2))
    tensors["weight"] = ((padded_codes[0::2] << 4) | padded_codes[1::2]).to(torch.uint8).unsqueeze(1)
    packed_state = torch.tensor(list(json.dumps(state).encode()), dtype=torch.uint8)
    tensors["weight.quant_state.bitsandbytes__nf4"] = packed_state
    return tensors, dense


def bnb8_quantize(w: torch.Tensor) -> tuple[dict, torch.Tensor]:
    """LLM.int8: int8 codes per row scaled by the row's absolute maximum (``SCB``) / 127."""
    scb = w.abs().amax(dim=1).clamp(min=1e-8)
    codes = torch.round(w * 127 / scb.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    dense = codes.float() * scb.unsqueeze(1) * 7.874015718698502e-3  # as bitsandbytes dequantizes
    return {"weight": codes, "SCB": scb, "weight_format": torch.tensor(0, dtype=torch.uint8)}, dense
