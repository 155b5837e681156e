"""The 8-bit forward's host side (ops/quantized.py): a torch reference of its quantizing pass and
arithmetic, tied to the CPU model of the scheme (bench/quantized_attention_accuracy.py); the launches, the
refusals, the setting, the variants. The kernels run in tests/gpu/test_quantized.py, against these
references."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch

import rdna_flash_attn as rfa
from rdna_flash_attn.config import Settings, settings
from rdna_flash_attn.dispatch import selftest
from rdna_flash_attn.ops import plans, quantized
from rdna_flash_attn.ops.launch_args import Fwd8Args, Quant8Args
from rdna_flash_attn.runtime import loader as runtime, variants

from bench import quantized_attention_accuracy as model

from .conftest import FAKE_ARTIFACT, _math_attention


class QCodes(NamedTuple):
    """What kernels/fa_fwd8.h makes of Q before its key loop (in LDS and registers)."""

    q8: torch.Tensor  # (B, H, Sq, d_pad) int8
    q_scale: torch.Tensor  # (B, H, Sq) float32: dequantisation x softmax scale x log2(e)


def _scale_for(amax, limit):
    return torch.where(amax > 0, amax / limit, torch.ones_like(amax))


def _int8(x, scale):
    return torch.round(x / scale).clamp(-127, 127).to(torch.int8)


def reference_q_codes(q, softmax_scale: float, variant) -> QCodes:
    """Q's int8 codes and row scales, as kernels/fa_fwd8.h computes them, in torch: (B, H, S, D) q. A
    negative softmax scale negates the codes and leaves the row scales positive."""
    qf = q.float() if softmax_scale >= 0 else -q.float()
    q_scale = _scale_for(qf.abs().amax(-1), 127.0)
    codes = torch.nn.functional.pad(_int8(qf, q_scale.unsqueeze(-1)), (0, variant.d_pad - q.shape[-1]))
    return QCodes(codes, q_scale * abs(softmax_scale) * math.log2(math.e))


def reference_quantize(k, v, variant) -> quantized.QuantizedInputs:
    """What kernels/quant8.h writes, in torch: (B, Hk, S, D) k and v."""
    batch, kv_heads, seq_k, dim = k.shape
    k_rows = -(-seq_k // variant.block_n) * variant.block_n

    def padded(x, rows):  # head dim to d_pad, tokens to `rows`
        return torch.nn.functional.pad(x, (0, variant.d_pad - dim, 0, rows - x.shape[2]))

    kf = k.float() - k.float().mean(2, keepdim=True)
    blocks = padded(kf, k_rows).view(batch, kv_heads, k_rows // 16, 16, variant.d_pad)
    k_scale = _scale_for(blocks.abs().amax((3, 4)), 127.0)
    vf = v.float()
    v_mean = vf.mean(2)
    centred = vf - v_mean.unsqueeze(2)
    v_scale = _scale_for(centred.abs().amax(2), quantized.FP8_MAX)
    e4m3 = (centred / v_scale.unsqueeze(2)).clamp(-quantized.FP8_MAX, quantized.FP8_MAX).to(torch.float8_e4m3fn)
    pad = (0, variant.d_pad - dim)
    return quantized.QuantizedInputs(
        _int8(blocks, k_scale[..., None, None]).view(batch, kv_heads, k_rows, variant.d_pad), k_scale,
        padded(e4m3.view(torch.uint8), k_rows).transpose(2, 3).contiguous(),
        torch.nn.functional.pad(v_scale, pad, value=1.0), torch.nn.functional.pad(v_mean, pad))


def dequantized_attention(q_codes: QCodes, inputs: quantized.QuantizedInputs, seq_k: int, dim: int) -> torch.Tensor:
    """What the 8-bit kernel computes from Q's codes and the pass's output, in float64 with the row's final
    maximum (the kernel rounds P against the running one): (B, H, Sq, dim)."""
    group = q_codes.q8.shape[1] // inputs.k8.shape[1]
    k8, k_scale, vt8, v_scale, v_mean = (t.repeat_interleave(group, 1) for t in inputs)
    keys = torch.arange(k8.shape[2], device=k8.device)
    scores = (q_codes.q8.double() @ k8.double().transpose(-1, -2)) * q_codes.q_scale.double()[..., None]
    scores = scores * k_scale.double().repeat_interleave(variants.FWD8_SCALE_KEYS, -1)[..., None, :]
    scores = scores.masked_fill(keys >= seq_k, float("-inf"))
    p = torch.exp2(scores - scores.amax(-1, keepdim=True)) * quantized.FP8_MAX
    p8 = p.float().to(torch.float8_e4m3fn).double()
    out = (p8 @ vt8.view(torch.float8_e4m3fn).double().transpose(-1, -2)) / p.sum(-1, keepdim=True)
    return (out * v_scale.double()[..., None, :] + v_mean.double()[..., None, :])[..., :dim]


def modelled_attention(q, k, v, softmax_scale: float, variant) -> torch.Tensor:
    """The 8-bit kernel's arithmetic on the reference's codes, in float64: (B, H, Sq, dim)."""
    return dequantized_attention(reference_q_codes(q, softmax_scale, variant), reference_quantize(k, v, variant),
                                 k.shape[2], q.shape[-1])


def flux_like(rows: int, keys: int, dtype=torch.float16, seed: int = 1):
    shape = next(s for s in model.SHAPES if s.name == "flux-joint-4608")
    q, k, v = model.diffusion_like(shape, 2, rows, dtype, torch.Generator().manual_seed(seed))
    return q, k[:, :keys], v[:, :keys]


def test_reference_pass_and_arithmetic_are_the_accuracy_models_scheme():
    q, k, v = flux_like(200, 1000)
    scale = 1 / math.sqrt(q.shape[-1])
    variant = variants.fwd8_variant("f16", q.shape[-1])
    ours = modelled_attention(*(t.unsqueeze(0) for t in (q, k, v)), scale, variant)[0].to(q.dtype)
    scheme = model.scheme_output("qkpv-int8-fp8-vsmooth", q, k, v, scale, (1, variants.FWD8_SCALE_KEYS))
    reference, _ = model.reference(q, k, v, scale)
    assert model.errors(ours, reference)["rel_l1"] == pytest.approx(model.errors(scheme, reference)["rel_l1"], rel=1e-3)
    assert (ours.double() - scheme.double()).abs().max() <= 2e-3


class RecordingLibrary:
    """A stand-in KernelLibrary for the CPU: records each launch's kernel, grid and argument block."""

    class artifact:  # noqa: N801  (what quantized_refusal reads of a library)
        target = "gfx1201"

    def __init__(self):
        self.launches = []

    def launcher(self, variant, grid, device):
        def launch(args, buffers):
            self.launches.append((variant.symbol, grid, type(args).from_buffer_copy(args)))
        return launch


@pytest.mark.parametrize("dtype,dim,layout", [(torch.float16, 40, "bhsd"), (torch.bfloat16, 128, "bshd")])
def test_launches(monkeypatch, dtype, dim, layout):
    """K and V's pass (two launches) and the attention's: kernels, grids, pointers, strides and sizes."""
    library = RecordingLibrary()
    monkeypatch.setattr(plans, "KERNEL_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(runtime, "library_for", lambda device: library)

    def make(heads, seq):
        t = torch.zeros((2, seq, heads, dim) if layout == "bshd" else (2, heads, seq, dim), dtype=dtype)
        return t.transpose(1, 2) if layout == "bshd" else t

    q, k, v = make(4, 100), make(2, 130), make(2, 130)
    out = quantized.quantized_attention_forward(q, k, v, scale=0.25)
    assert out.shape == q.shape and out.stride() == q.stride()
    (stats, stats_grid, pass_args), (codes, codes_grid, codes_args), (attention, grid, args) = library.launches
    d_pad, name = variants.padded_head_dim(dim), {torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]
    assert (stats, stats_grid) == (f"rdna_fa_quant8_stats_{name}_d{d_pad}", (1, 2, 2))
    assert (codes, codes_grid) == (f"rdna_fa_quant8_codes_{name}_d{d_pad}", (3, 2, 2))  # 192 key rows: 3 blocks
    assert (attention, grid) == (f"rdna_fa_fwd8_{name}_d{d_pad}", (2, 4, 2))
    assert bytes(pass_args) == bytes(codes_args)
    assert (pass_args.k, pass_args.v) == (k.data_ptr(), v.data_ptr())
    assert [getattr(pass_args, f"{t}_stride_{d}") for t in "kv" for d in "bhs"] == [
        s for t in (k, v) for s in t.stride()[:3]]
    assert (pass_args.kv_heads, pass_args.seqlen_k, pass_args.k_rows, pass_args.head_dim) == (2, 130, 192, dim)
    assert (args.q, args.q_stride_b, args.q_stride_h, args.q_stride_s) == (q.data_ptr(), *q.stride()[:3])
    assert (args.k8, args.k_scale, args.vt8, args.v_scale, args.v_mean) == (
        pass_args.k8, pass_args.k_scale, pass_args.vt8, pass_args.v_scale, pass_args.v_mean)
    assert (args.o, args.o_stride_b, args.o_stride_h, args.o_stride_s) == (out.data_ptr(), *out.stride()[:3])
    assert (args.heads, args.kv_heads, args.seqlen_q, args.seqlen_k, args.k_rows, args.head_dim) == (
        4, 2, 100, 130, 192, dim)
    assert args.scale_log2 == pytest.approx(0.25 * math.log2(math.e))


def test_bad_input_is_named(monkeypatch):
    monkeypatch.setattr(plans, "KERNEL_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(runtime, "library_for", lambda device: RecordingLibrary())
    q = torch.zeros(1, 2, 8, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="dtype torch.float32 is not supported"):
        quantized.quantized_attention_forward(q.float(), q.float(), q.float())
    wide = torch.zeros(1, 2, 8, 256, dtype=torch.float16)
    with pytest.raises(ValueError, match="head dims 40-160"):
        quantized.quantized_attention_forward(wide, wide, wide)


def test_refusals():
    q = torch.zeros(1, 2, 8, 64, dtype=torch.float16)
    assert quantized.target_refusal("gfx1201") is None and quantized.target_refusal("emulated-gfx12") is None
    assert "RDNA4" in quantized.target_refusal("gfx1100") and "RDNA4" in quantized.target_refusal("emulated-gfx11")
    assert quantized.plan_quantized(q, q, q).variant.symbol == "rdna_fa_fwd8_f16_d64"
    assert quantized.plan_quantized(q, q, q, dtype=torch.bfloat16).variant.symbol == "rdna_fa_fwd8_bf16_d64"
    assert "attn_mask" in refusal(quantized.plan_quantized(q, q, q, False, torch.ones(8, 8, dtype=torch.bool)))
    assert "causal" in refusal(quantized.plan_quantized(q, q, q, True))
    for dim in (40, 104, 112, 136, 144, 160):
        t = torch.zeros(1, 2, 8, dim, dtype=torch.float16)
        assert isinstance(quantized.plan_quantized(t, t, t), quantized.QuantizedPlan), dim
    for dim in (32, 168, 256):
        t = torch.zeros(1, 2, 8, dim, dtype=torch.float16)
        assert f"head dims 40-160, not {dim}" in refusal(quantized.plan_quantized(t, t, t))
    q128 = torch.zeros(1, 2, 8, 128, dtype=torch.float16)
    long_keys = torch.zeros(1, 1, 2**31 // 128, 128, dtype=torch.float16, device="meta")
    assert "keys x head dim below 2^31" in refusal(quantized.plan_quantized(q128, long_keys, long_keys))
    fits = long_keys[:, :, : 2**31 // 128 - 2 * variants.FWD8_BLOCK_N]
    assert isinstance(quantized.plan_quantized(q128, fits, fits), quantized.QuantizedPlan)


def refusal(plan) -> str:
    assert isinstance(plan, plans.Refusal), plan
    return plan.reason


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
    gfx12, gfx11 = lines[lines.index("#if defined(__GFX12__)"):lines.index("#else")], lines[lines.index("#else"):]
    assert any("FWD8" in line for line in gfx12) and not any("FWD8" in line for line in gfx11)
    assert variants.fwd8_variant("f16", 40).d_pad == 48 and variants.FWD8_HEAD_DIMS[-1] == 160
    assert set(variants.QUANT8_BY_SYMBOL) <= set(variants.target_symbols("gfx1200"))
    assert not set(variants.QUANT8_BY_SYMBOL) & set(variants.target_symbols("gfx1151"))
    assert ctypes_fields(Fwd8Args)[:10] == ["q", "q_stride_b", "q_stride_h", "q_stride_s", "k8", "k_scale", "vt8",
                                            "v_scale", "v_mean", "o"]
    assert ctypes_fields(Quant8Args)[8:14] == ["k8", "k_scale", "vt8", "k_mean", "v_mean", "v_scale"]


def ctypes_fields(structure) -> list[str]:
    return [name for name, _ in structure._fields_]


# --- the dispatcher's 8-bit route, on the CPU's fake GPU (tests/conftest.py) --------------------------


@pytest.fixture
def fake_rdna4(fake_gpu, monkeypatch):
    """fake_gpu as an RX 9070 XT whose 8-bit attention is float32 math plus `error`, or raises `raises`."""
    monkeypatch.setitem(FAKE_ARTIFACT, "target", "gfx1201")
    fake_gpu.devices.info["gfx_target"] = "gfx1201"
    fake_gpu.eight_bit = SimpleNamespace(calls=0, error=0.0, raises=None)

    def eight_bit(q, k, v, scale=None):
        fake_gpu.eight_bit.calls += 1
        if fake_gpu.eight_bit.raises is not None:
            raise fake_gpu.eight_bit.raises
        return _math_attention(q, k, v, scale=scale)[0] + fake_gpu.eight_bit.error
    monkeypatch.setattr(quantized, "quantized_attention_forward", eight_bit)  # the self-test's
    monkeypatch.setattr(quantized, "launch_quantized",  # the dispatcher's
                        lambda plan, q, k, v: eight_bit(q, k, v, plan.scale))
    checks = selftest.eight_bit_checks
    monkeypatch.setattr(selftest, "eight_bit_checks", lambda device: checks(torch.device("cpu")))  # the CPU plays it
    settings.precision = "8bit-qkpv"
    return fake_gpu


def _qkv(dim=64):
    """Inputs within the 8-bit bar (quantized.accuracy_refusal): V with channel means."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, dim, generator=generator) for _ in range(3))
    return (t.half() for t in (q, k, v + torch.randn(1, 2, 1, dim, generator=generator)))


def test_rdna3_stays_exact_and_says_why(fake_gpu):
    settings.precision = "8bit-qkpv"
    q, k, v = _qkv()
    rfa.scaled_dot_product_attention(q, k, v)
    reason = "8-bit attention needs RDNA4 (gfx12); gfx1100 has no faster 8-bit matrix rate"
    assert rfa.stats()["exact_not_8bit_reasons"] == {reason: 1} and rfa.stats()["kernel_8bit"] == 0
    assert rfa.explain(q, k, v).endswith(f"exact, not 8-bit: {reason}")


def test_rdna4_runs_8bit_after_its_selftest(fake_rdna4):
    q, k, v = _qkv()
    rfa.scaled_dot_product_attention(q, k, v)
    selftest_calls = 2 * len(selftest.EIGHT_BIT_CASES)
    assert fake_rdna4.eight_bit.calls == selftest_calls + 1
    rfa.scaled_dot_product_attention(q, k, v, is_causal=True)
    with torch.enable_grad():
        rfa.scaled_dot_product_attention(*(t.requires_grad_() for t in _qkv()))
    assert fake_rdna4.eight_bit.calls == selftest_calls + 1
    assert rfa.stats()["kernel_8bit"] == 1 and rfa.stats()["exact_not_8bit_reasons"] == {
        "8-bit attention is not causal": 1, "gradients needed (8-bit attention is for inference)": 1}


def test_a_negative_scale_runs_8bit(fake_rdna4):
    q, k, v = _qkv()
    rfa.scaled_dot_product_attention(q, k, v)  # self-test and one 8-bit call
    out = rfa.scaled_dot_product_attention(q, k, v, scale=-0.125)
    assert torch.allclose(out, _math_attention(q, k, v, scale=-0.125)[0], atol=2e-3)
    assert rfa.stats()["kernel_8bit"] == 2 and rfa.stats()["exact_not_8bit_reasons"] == {}


def test_the_reference_folds_a_negative_scale_into_q():
    """The kernel's Q codes for scale -s are those of -Q for s: the float64 model of its arithmetic stays
    as close to float64 attention as with the positive scale."""
    q, k, v = (t.unsqueeze(0) for t in flux_like(64, 300))
    variant = variants.fwd8_variant("f16", q.shape[-1])
    scale = 1 / math.sqrt(q.shape[-1])
    codes, flipped = reference_q_codes(q, scale, variant), reference_q_codes(q, -scale, variant)
    assert torch.equal(flipped.q8, -codes.q8) and torch.equal(flipped.q_scale, codes.q_scale)
    for s in (scale, -scale):
        ours = modelled_attention(q, k, v, s, variant)
        exact = _math_attention(q.double(), k.double(), v.double(), scale=s)[0]
        assert model.errors(ours, exact)["rel_l1"] < 0.03, s


def test_a_failed_8bit_selftest_keeps_the_exact_kernels(fake_rdna4, log_records):
    fake_rdna4.eight_bit.error = 0.5
    q, k, v = _qkv()
    rfa.scaled_dot_product_attention(q, k, v)
    (reason,) = rfa.stats()["exact_not_8bit_reasons"]
    assert reason.startswith(
        "8-bit attention's self-test failed: 8-bit float16 b1 h2/2 q100 k130 d64 scale 0.125 relative L1")
    assert rfa.stats()["kernel"] == 1 and rfa.stats()["kernel_8bit"] == 0 and len(fake_rdna4.launches) == 1
    assert any("its calls run the exact kernels" in r.getMessage() for r in log_records.records)


def test_a_failing_8bit_kernel_turns_off_8bit_only(fake_rdna4):
    q, k, v = _qkv()
    rfa.scaled_dot_product_attention(q, k, v)  # self-test and one 8-bit call
    fake_rdna4.eight_bit.raises = RuntimeError("hipErrorIllegalAddress")
    out = rfa.scaled_dot_product_attention(q, k, v)
    assert torch.allclose(out, _math_attention(q, k, v)[0])
    rfa.scaled_dot_product_attention(q, k, v)
    stats = rfa.stats()
    assert stats["kernel"] == 3 and stats["kernel_8bit"] == 1 and stats["fallback"] == 0
    assert stats["exact_not_8bit_reasons"] == {  # the failed call and the next (the fake GPU's tensors are the CPU's)
        "8-bit attention failed (RuntimeError: hipErrorIllegalAddress); off for cpu": 2}


def test_the_8bit_selftest_bar_has_room_for_the_arithmetic_itself(monkeypatch):
    """selftest.eight_bit_checks with the float64 model of the kernels' arithmetic standing in for them:
    every check passes with at least half its bar to spare, so a failure on a GPU points at the kernels."""

    def modelled(q, k, v, scale):  # the self-test passes every case's scale
        variant = variants.fwd8_variant({torch.float16: "f16", torch.bfloat16: "bf16"}[q.dtype], q.shape[-1])
        return modelled_attention(q, k, v, scale, variant).to(q.dtype)

    monkeypatch.setattr(quantized, "quantized_attention_forward", modelled)
    checks = selftest.eight_bit_checks(torch.device("cpu"))
    assert len(checks) == 2 * 2 * len(selftest.EIGHT_BIT_CASES)
    assert all(check.error <= check.tolerance / 2 for check in checks), [c for c in checks if c.error > c.tolerance / 2]


# --- the guard: inputs outside the 8-bit bar run exact -----------------------------------------------


def _iid(tokens=1024, dim=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, tokens, dim, generator=generator).half() for _ in range(3)]


def test_input_statistics_are_the_definitions_in_float64():
    q, k, v = _iid(300, 40)
    q[..., 3] *= 20
    k[:, 1] += 5.0  # a shift per channel of head 1: K's statistic is taken about its mean
    q64, k64, v64 = (t.double()[0] for t in (q, k, v))

    def spread(x):
        amax = x.abs().amax(dim=1)
        return float((amax.amax(dim=-1) / amax.median(dim=-1).values).amax())
    v_mean = v64.mean(dim=1)
    v_range = (v64 - v64.mean(dim=1, keepdim=True)).abs().amax(dim=1)
    stats = quantized.input_statistics(q, k, v)
    assert stats.q_channel_spread == pytest.approx(spread(q64), rel=1e-3)
    assert stats.k_channel_spread == pytest.approx(spread(k64 - k64.mean(dim=1, keepdim=True)), rel=1e-3)
    assert stats.v_mean_over_range == pytest.approx(float((v_mean.norm(dim=-1) / v_range.norm(dim=-1)).amin()),
                                                    rel=1e-3)


def test_accuracy_refusal_takes_model_like_inputs_and_refuses_what_misses_the_bar():
    q, k, v = (t.unsqueeze(0) for t in flux_like(256, 1024))
    assert quantized.accuracy_refusal(q, k, v) is None
    assert "V's channel means under 0.06" in quantized.accuracy_refusal(*_iid())
    for outlier in (q, k):
        spiked = outlier.clone()
        spiked[..., 5] = spiked[..., 5] * 100
        args = (spiked, k, v) if outlier is q else (q, spiked, v)
        assert "channel's range over 8x" in quantized.accuracy_refusal(*args)
    nan_v = v.clone()
    nan_v[0, 0, 3, 0] = float("nan")
    assert "NaN or infinite" in quantized.accuracy_refusal(q, k, nan_v)
    constant_v = torch.ones_like(v)  # no range: the output is the mean, carried exactly
    assert quantized.accuracy_refusal(q, k, constant_v) is None
    assert quantized.accuracy_refusal(q[:, :, :0], k, v) is None and quantized.accuracy_refusal(q, k[:, :, :0],
                                                                                                  v[:, :, :0]) is None


def test_dispatcher_runs_inputs_outside_the_bar_exact_and_keeps_8bit_for_the_rest(fake_rdna4):
    model_like = [t.unsqueeze(0) for t in flux_like(128, 512)]
    rfa.scaled_dot_product_attention(*model_like)  # self-test and one 8-bit call
    calls = fake_rdna4.eight_bit.calls
    iid = _iid()
    out = rfa.scaled_dot_product_attention(*iid)
    assert fake_rdna4.eight_bit.calls == calls
    assert torch.allclose(out.float(), _math_attention(*(t.float() for t in iid))[0], atol=2e-3)
    rfa.scaled_dot_product_attention(*model_like)
    stats = rfa.stats()
    assert fake_rdna4.eight_bit.calls == calls + 1 and stats["kernel_8bit"] == 2 and stats["kernel"] == 3
    assert stats["exact_not_8bit_reasons"] == {
        "inputs outside 8-bit attention's bar: V's channel means under 0.06 of its range": 1}
    assert rfa.explain(*iid).endswith("exact, not 8-bit: inputs outside 8-bit attention's bar: V's channel means "
                                      "under 0.06 of its range")
    assert rfa.explain(*model_like).endswith("in 8-bit attention (int8 Q K^T, fp8 P V)")
