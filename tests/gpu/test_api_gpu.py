"""The public API through the real kernels on a GPU: on NVIDIA the emulation of each AMD layer, which
runs only with RDNA_FA_FORCE=1 (policy keeps it off otherwise). Skips cleanly without CUDA.

The same contract as the CPU tests (tests/test_api.py), now with real launches: supported calls
match SDPA within FlashAttention's tolerance, everything else gives SDPA's own result or exception
type, and refused input never reaches a kernel.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import rdna_flash_attn as rfa
from rdna_flash_attn.ops import attention as ops
from rdna_flash_attn.runtime import loader as runtime, variants
from rdna_flash_attn.dispatch import selftest
from rdna_flash_attn.config import settings

from ..test_api import BAD_CALLS, outcome, random_call
from ..test_flash_attn_compat import reference as naive_flash_attn
from .conftest import GPU
from rdna_fa_lab.attention_reference import (attention_fp64, backward_bound, grads_fp64, grads_input_dtype, max_error,
                                             sdpa_math)

TORCH_SDPA = F.scaled_dot_product_attention


@pytest.fixture
def launches(kernels_on, monkeypatch):
    """Kernels on for this GPU, the buffers (q, k, v, out, lse) of every forward kernel launch recorded
    where the launch happens, so prepared launches (the dispatcher's and ops') count too."""
    recorded = []
    real = runtime.KernelLibrary.launcher

    def recording_launcher(library, variant, grid, device):
        launch = real(library, variant, grid, device)
        if not isinstance(variant, variants.FwdVariant):
            return launch

        def recording_launch(args, buffers):
            recorded.append(buffers)
            launch(args, buffers)

        return recording_launch

    monkeypatch.setattr(runtime.KernelLibrary, "launcher", recording_launcher)
    ops.forget_launches()  # launches prepared before (the self-test's) would go unrecorded
    return recorded


def to_gpu(args, kwargs):
    move = lambda t: t.to(GPU) if isinstance(t, torch.Tensor) and t.device.type == "cpu" else t  # noqa: E731
    return [move(a) for a in args], {k: move(v) for k, v in kwargs.items()}


def assert_flash_accuracy(out, q, k, v, is_causal=False, scale=None):
    """FlashAttention's criterion: error against fp64 within 2x math SDPA's in the same dtype."""
    reference, _ = attention_fp64(q, k, v, is_causal, scale)
    yardstick = max_error(sdpa_math(q, k, v, is_causal, scale), reference)
    assert out.dtype == q.dtype and out.shape == reference.shape
    assert max_error(out, reference) <= 2 * yardstick + 1e-5


def test_selftest_passes_on_this_gpu(launches):
    record = selftest.run(GPU, runtime.loaded_library_for(GPU))
    assert record["passed"], [c for c in record["checks"] if not c["passed"]]


def test_selftest_passes_when_the_first_call_comes_under_inference_mode(launches):
    # ComfyUI runs every node under torch.inference_mode: a first call there runs the self-test there
    with torch.inference_mode():
        record = selftest.run(GPU, runtime.loaded_library_for(GPU))
    assert record["passed"], record["reason"] or [c for c in record["checks"] if not c["passed"]]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "shape, kwargs",
    [
        ((2, 8, 1024, 1024, 40), {}),  # SD1.5 self-attention, 4x smaller
        ((2, 8, 1024, 77, 80), {}),  # SD1.5 cross-attention
        ((2, 10, 1024, 1024, 64), {}),  # SDXL
        ((1, 24, 1100, 1100, 128), {}),  # Flux joint, shortened
        ((1, 1, 1024, 1024, 512), {}),  # VAE mid-block
        ((2, 8, 256, 256, 160), {"scale": 0.07}),
        ((1, 3, 200, 120, 64), {"is_causal": True}),  # top-left with Sq > Sk
        ((1, 3, 120, 200, 96), {"is_causal": True}),
    ],
)
def test_supported_calls_run_on_the_kernels(launches, dtype, shape, kwargs):
    batch, heads, q_len, k_len, dim = shape
    q, k, v = (torch.randn(batch, heads, n, dim, device=GPU, dtype=dtype) for n in (q_len, k_len, k_len))
    out = rfa.scaled_dot_product_attention(q, k, v, **kwargs)
    assert len(launches) == 1 and rfa.stats()["kernel"] == 1
    assert_flash_accuracy(out, q, k, v, kwargs.get("is_causal", False), kwargs.get("scale"))


@pytest.mark.parametrize("seed", range(120))
def test_random_calls_match_torch(launches, seed):
    args, kwargs = to_gpu(*random_call(random.Random(seed)))
    theirs = outcome(TORCH_SDPA, args, kwargs)
    ours = outcome(rfa.scaled_dot_product_attention, args, kwargs)
    if isinstance(theirs, type):
        assert ours is theirs and not launches
        return
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    if launches:
        assert_flash_accuracy(ours, *args[:3], kwargs.get("is_causal", False), kwargs.get("scale"))
    else:
        assert torch.equal(ours.nan_to_num(7.0), theirs.nan_to_num(7.0))


@pytest.fixture
def without_cudnn_sdpa():
    # torch's cuDNN SDPA raises for a key head dim unlike the query's, then segfaults when the same
    # call is made again (torch 2.11, H200); the other backends raise every time, so compare on them.
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    yield
    torch.backends.cuda.enable_cudnn_sdp(enabled)


@pytest.mark.parametrize("name", BAD_CALLS)
def test_bad_calls_raise_sdpas_exception_type_without_a_launch(launches, without_cudnn_sdpa, name):
    args, kwargs = to_gpu(*BAD_CALLS[name]())
    theirs = outcome(TORCH_SDPA, args, kwargs)
    assert isinstance(theirs, type)
    assert outcome(rfa.scaled_dot_product_attention, args, kwargs) is theirs
    assert not launches


def test_cpu_and_gpu_tensors_mixed(launches):
    q = torch.randn(1, 2, 16, 64, device=GPU, dtype=torch.float16)
    k = torch.randn(1, 2, 16, 64, dtype=torch.float16)
    assert outcome(rfa.scaled_dot_product_attention, (q, k, k), {}) is outcome(TORCH_SDPA, (q, k, k), {})
    assert not launches


@pytest.mark.parametrize("q_len, k_len, dim", [(0, 16, 64), (16, 0, 64), (16, 16, 0)])
def test_empty_tensors(launches, q_len, k_len, dim):
    q = torch.randn(1, 2, q_len, dim, device=GPU, dtype=torch.float16)
    k = torch.randn(1, 2, k_len, dim, device=GPU, dtype=torch.float16)
    ours, theirs = rfa.scaled_dot_product_attention(q, k, k), TORCH_SDPA(q, k, k)
    if theirs is None:  # torch 2.11's CUDA SDPA returns no tensor for head dim 0: so must we
        assert ours is None
    else:
        assert ours.shape == theirs.shape and torch.equal(ours.nan_to_num(7.0), theirs.nan_to_num(7.0))
    assert not launches


def test_nan_inputs_give_sdpas_nan_pattern(launches):
    q, k, v = (torch.randn(1, 2, 64, 64, device=GPU, dtype=torch.float16) for _ in range(3))
    q[0, 0, 3, 5] = float("nan")
    k[0, 1, 7, 0] = float("nan")
    ours, theirs = rfa.scaled_dot_product_attention(q, k, v), sdpa_math(q, k, v)
    assert len(launches) == 1
    assert torch.equal(ours.isnan(), theirs.isnan())


@pytest.mark.parametrize("bad", [float("inf"), float("-inf")])
def test_inf_inputs_leave_untouched_rows_exact(launches, bad):
    q, k, v = (torch.randn(1, 2, 64, 64, device=GPU, dtype=torch.float16) for _ in range(3))
    q[0, 0, 3, 5] = bad
    ours = rfa.scaled_dot_product_attention(q, k, v)
    assert len(launches) == 1
    rows = [r for r in range(64) if r != 3]
    assert_flash_accuracy(ours[:, :, rows], q[:, :, rows], k, v)


def test_strided_and_misaligned_views(launches):
    wide = torch.randn(2, 40, 3, 128, device=GPU, dtype=torch.float16)
    strided = wide[..., ::2].transpose(1, 2)  # head dim not contiguous: SDPA
    ours = rfa.scaled_dot_product_attention(strided, strided, strided)
    assert torch.equal(ours, TORCH_SDPA(strided, strided, strided))
    flat = torch.randn(2 * 3 * 40 * 64 + 4, device=GPU, dtype=torch.float16)
    misaligned = flat[4:].view(2, 3, 40, 64)  # 8-byte storage offset: SDPA
    assert torch.equal(rfa.scaled_dot_product_attention(misaligned, misaligned, misaligned),
                       TORCH_SDPA(misaligned, misaligned, misaligned))
    assert not launches
    bshd = wide[..., :64].transpose(1, 2)  # (B, S, H, D) memory seen as (B, H, S, D): kernels
    assert_flash_accuracy(rfa.scaled_dot_product_attention(bshd, bshd, bshd), bshd, bshd, bshd)
    assert len(launches) == 1


def test_autocast_and_fp32_cast(launches):
    q, k, v = (torch.randn(2, 4, 128, 64, device=GPU) for _ in range(3))
    with torch.autocast("cuda", dtype=torch.float16):
        out = rfa.scaled_dot_product_attention(q, k, v)
        expected_dtype = TORCH_SDPA(q, k, v).dtype
    assert out.dtype == expected_dtype == torch.float16 and len(launches) == 1
    settings.fp32_cast = "bf16"
    out = rfa.scaled_dot_product_attention(q, k, v)
    assert out.dtype == torch.float32 and launches[-1][0].dtype == torch.bfloat16
    torch.testing.assert_close(out, sdpa_math(q, k, v), atol=3e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape, causal", [((2, 8, 1024, 1024, 40), False), ((1, 3, 200, 120, 64), True)])
def test_gradients_through_the_kernels(launches, dtype, shape, causal):
    """Backward on the kernels: each gradient's error against fp64 within FlashAttention-2's bound."""
    batch, heads, q_len, k_len, dim = shape
    q, k, v = (torch.randn(batch, heads, n, dim, device=GPU, dtype=dtype, requires_grad=True)
               for n in (q_len, k_len, k_len))
    grad_out = torch.randn(batch, heads, q_len, dim, device=GPU, dtype=dtype)
    ours = torch.autograd.grad(rfa.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), grad_out)
    # One launch, through the differentiable op (autograd.grad above fails on a plain forward).
    assert rfa.stats()["kernel"] == 1 and len(launches) == 1
    reference = grads_fp64(q, k, v, grad_out, causal)
    input_dtype = grads_input_dtype(q, k, v, grad_out, causal)
    for name, got, ref, yardstick in zip("qkv", ours, reference, input_dtype):
        assert got.dtype == dtype and max_error(got, ref) <= backward_bound(max_error(yardstick, ref)), name


def test_the_current_stream_is_used(launches):
    q, k, v = (torch.randn(2, 8, 512, 64, device=GPU, dtype=torch.float16) for _ in range(3))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = rfa.scaled_dot_product_attention(q, k, v)
    stream.synchronize()
    assert len(launches) == 1
    assert_flash_accuracy(out, q, k, v)


def test_patch_sdpa_routes_torch_sdpa(launches):
    q = torch.randn(1, 2, 64, 64, device=GPU, dtype=torch.float16)
    original = F.scaled_dot_product_attention
    with rfa.patch_sdpa():
        F.scaled_dot_product_attention(q, q, q)
    assert F.scaled_dot_product_attention is original and len(launches) == 1


@pytest.mark.parametrize(
    "shape, kwargs, on_kernels",
    [
        (dict(q_len=300, k_len=300), {}, True),
        (dict(q_len=300, k_len=300), {"causal": True}, True),
        (dict(q_len=100, k_len=300), {"causal": True}, True),  # bottom-right: a mask
        (dict(q_len=300, k_len=300, heads=8, kv_heads=2), {}, True),
        (dict(q_len=300, k_len=300), {"window_size": (32, 32)}, True),
    ],
)
def test_flash_attn_func(launches, shape, kwargs, on_kernels):
    batch, heads, kv_heads = 2, shape.get("heads", 4), shape.get("kv_heads", 4)
    q = torch.randn(batch, shape["q_len"], heads, 64, device=GPU, dtype=torch.float16)
    k, v = (torch.randn(batch, shape["k_len"], kv_heads, 64, device=GPU, dtype=torch.float16) for _ in range(2))
    out = rfa.flash_attn_func(q, k, v, **kwargs)
    assert out.shape == q.shape and out.is_contiguous() and bool(launches) is on_kernels
    if on_kernels:
        assert launches[0][0].data_ptr() == q.data_ptr()  # the caller's memory, no copy
    k_full, v_full = (t.repeat_interleave(heads // kv_heads, dim=2) for t in (k, v))
    expected, _ = naive_flash_attn(q.cpu(), k_full.cpu(), v_full.cpu(), causal=kwargs.get("causal", False),
                                   window=kwargs.get("window_size", (-1, -1)))
    torch.testing.assert_close(out.cpu().double(), expected, atol=4e-3, rtol=0)


def test_explain(launches):
    q = torch.randn(1, 2, 64, 64, device=GPU, dtype=torch.bfloat16)
    assert rfa.explain(q, q, q).startswith("runs on the kernels")
    assert "mask" in rfa.explain(q, q, q, attn_mask=torch.ones(64, 64, dtype=torch.bool, device=GPU))
    assert not launches
