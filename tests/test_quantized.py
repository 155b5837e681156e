"""The 8-bit forward's host side (ops/quantized.py, issue 24): the quantizing pass against the CPU model
of the scheme (bench/quantized_attention_accuracy.py), the refusals, the setting, the variants. The
kernel itself runs in tests/gpu/test_quantized.py."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from rdna_flash_attn.config import Settings
from rdna_flash_attn.ops import quantized
from rdna_flash_attn.ops.launch_args import Fwd8Args
from rdna_flash_attn.runtime import variants

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import quantized_attention_accuracy as model  # noqa: E402


def dequantized_attention(inputs: quantized.QuantizedInputs, seq_k: int, dim: int) -> torch.Tensor:
    """What the 8-bit kernel computes from its inputs, in float64 with the row's final maximum (the
    kernel rounds P against the running one): (B, H, Sq, dim)."""
    group = inputs.q8.shape[1] // inputs.k8.shape[1]
    k8, k_scale, vt8, v_scale, v_mean = (t.repeat_interleave(group, 1) for t in inputs[2:])
    keys = torch.arange(k8.shape[2], device=k8.device)
    scores = (inputs.q8.double() @ k8.double().transpose(-1, -2)) * inputs.q_scale.double()[..., None]
    scores = scores * k_scale.double().repeat_interleave(variants.FWD8_SCALE_KEYS, -1)[..., None, :]
    scores = scores.masked_fill(keys >= seq_k, float("-inf"))
    p = torch.exp2(scores - scores.amax(-1, keepdim=True)) * quantized.FP8_MAX
    p8 = p.float().to(torch.float8_e4m3fn).double()
    out = (p8 @ vt8.view(torch.float8_e4m3fn).double().transpose(-1, -2)) / p.sum(-1, keepdim=True)
    return (out * v_scale.double()[..., None, :] + v_mean.double()[..., None, :])[..., :dim]


def flux_like(rows: int, keys: int, dtype=torch.float16, seed: int = 1):
    shape = next(s for s in model.SHAPES if s.name == "flux-joint-4608")
    q, k, v = model.diffusion_like(shape, 2, rows, dtype, torch.Generator().manual_seed(seed))
    return q, k[:, :keys], v[:, :keys]


def test_pass_and_dequantized_arithmetic_are_the_accuracy_models_scheme():
    q, k, v = flux_like(200, 1000)
    scale = 1 / math.sqrt(q.shape[-1])
    inputs = quantized.quantize_inputs(*(t.unsqueeze(0) for t in (q, k, v)), scale,
                                       variants.fwd8_variant("f16", q.shape[-1]))
    ours = dequantized_attention(inputs, k.shape[1], q.shape[-1])[0].to(q.dtype)
    scheme = model.scheme_output("qkpv-int8-fp8-vsmooth", q, k, v, scale, (1, variants.FWD8_SCALE_KEYS))
    reference, _ = model.reference(q, k, v, scale)
    assert model.errors(ours, reference)["rel_l1"] == pytest.approx(model.errors(scheme, reference)["rel_l1"], rel=1e-3)
    assert (ours.double() - scheme.double()).abs().max() <= 2e-3


@pytest.mark.parametrize("dim,seq_k", [(40, 1), (72, 65), (128, 64), (160, 130)])
def test_pass_layout(dim, seq_k):
    """Head dim zero-padded, keys padded to whole tiles (zero codes, unit scales), V transposed,
    codes within range, Q's scale carrying softmax scale x log2(e)."""
    generator = torch.Generator().manual_seed(dim + seq_k)
    q = torch.randn(2, 4, 33, dim, generator=generator).half()
    k, v = (torch.randn(2, 2, seq_k, dim, generator=generator).half() for _ in range(2))
    variant = variants.fwd8_variant("f16", dim)
    inputs = quantized.quantize_inputs(q, k, v, 0.5, variant)
    k_rows = -(-seq_k // variant.block_n) * variant.block_n
    assert inputs.q8.shape == (2, 4, 33, variant.d_pad) and inputs.k8.shape == (2, 2, k_rows, variant.d_pad)
    assert inputs.vt8.shape == (2, 2, variant.d_pad, k_rows)
    assert inputs.k_scale.shape == (2, 2, k_rows // 16)
    for t in (inputs.q8, inputs.k8):
        assert not t[..., dim:].any() and t.abs().max() <= 127
    assert not inputs.k8[:, :, seq_k:].any() and not inputs.vt8[:, :, :, seq_k:].any()
    assert not inputs.vt8[:, :, dim:].any()
    amax = q.float().abs().amax(-1)
    assert torch.allclose(inputs.q_scale, amax / 127 * 0.5 * math.log2(math.e))
    centred = v.float() - v.float().mean(2, keepdim=True)
    decoded = inputs.vt8[:, :, :dim, :seq_k].view(torch.float8_e4m3fn).float().transpose(2, 3)
    subnormal_step = float(inputs.v_scale.max()) * 2**-9  # e4m3's spacing near zero
    assert torch.allclose(decoded * inputs.v_scale[:, :, None, :dim], centred, rtol=2**-4, atol=subnormal_step)
    assert torch.equal(inputs.v_scale[..., dim:], torch.ones_like(inputs.v_scale[..., dim:]))


def test_pass_works_a_few_heads_at_a_time(monkeypatch):
    """The pass's per-step head slices give what one step over every head gives."""
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 5, 70, 64, generator=generator).bfloat16() for _ in range(3))
    variant = variants.fwd8_variant("bf16", 64)
    whole = quantized.quantize_inputs(q, k, v, 0.125, variant)
    monkeypatch.setattr(quantized, "_PASS_ELEMENTS", 70 * 64 * 2)
    assert [s.stop for s in quantized._head_slices(5, 70, 64)] == [2, 4, 5]
    for a, b in zip(whole, quantized.quantize_inputs(q, k, v, 0.125, variant)):
        assert torch.equal(a, b)


def test_refusals():
    q = torch.zeros(1, 2, 8, 64, dtype=torch.float16)
    assert quantized.quantized_refusal(q, q, q, False, None, "gfx1201") is None
    assert quantized.quantized_refusal(q, q, q, False, None, "emulated-gfx12") is None
    assert "RDNA4" in quantized.quantized_refusal(q, q, q, False, None, "gfx1100")
    assert "RDNA4" in quantized.quantized_refusal(q, q, q, False, None, "emulated-gfx11")
    assert "attn_mask" in quantized.quantized_refusal(q, q, q, False, torch.ones(8, 8, dtype=torch.bool), "gfx1201")
    assert "causal" in quantized.quantized_refusal(q, q, q, True, None, "gfx1201")
    wide = torch.zeros(1, 2, 8, 256, dtype=torch.float16)
    assert "head dims 40-160, not 256" in quantized.quantized_refusal(wide, wide, wide, False, None, "gfx1201")


def test_precision_setting():
    assert Settings().precision == "exact"
    assert Settings.from_env({"RDNA_FA_PRECISION": " 8BIT-QKPV "}).precision == "8bit-qkpv"
    with pytest.raises(ValueError, match="missed their accuracy bar"):
        Settings().precision = "8bit-qk"
    with pytest.raises(ValueError, match="expected one of exact, 8bit-qkpv"):
        Settings().precision = "int4"


def test_variants_only_on_gfx12():
    assert all(s not in variants.target_symbols("gfx1100") for s in variants.FWD8_BY_SYMBOL)
    assert set(variants.FWD8_BY_SYMBOL) <= set(variants.target_symbols("gfx1201"))
    assert set(variants.FWD8_BY_SYMBOL) <= set(variants.target_symbols("emulated-gfx12"))
    lines = variants.instantiation_lines().splitlines()
    first = next(i for i, line in enumerate(lines) if "FWD8" in line)
    assert lines[first - 1] == "#if defined(__GFX12__)" and lines[-1] == "#endif"
    assert variants.fwd8_variant("f16", 40).d_pad == 48 and variants.FWD8_HEAD_DIMS[-1] == 160
    assert ctypes_fields(Fwd8Args)[:8] == ["q8", "q_scale", "k8", "k_scale", "vt8", "v_scale", "v_mean", "o"]


def ctypes_fields(structure) -> list[str]:
    return [name for name, _ in structure._fields_]
