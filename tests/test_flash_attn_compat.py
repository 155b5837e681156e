"""flash-attn 2.8.3's API on the dispatcher: results against a float64 reference of flash-attn's
documented semantics, the argument patterns of real call sites (HunyuanVideo, HunyuanImage, sd-scripts,
Lumina 2 / OmniGen2, Wan, HiDream, diffusers), the private forward/backward pair diffusers' context
parallelism drives, bert_padding, and the opt-in that puts the `flash_attn` stand-in on sys.path
without ever shadowing a real flash-attn."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import rdna_flash_attn as rfa
from rdna_flash_attn.integrations import autoload, launch
from rdna_flash_attn.integrations import flash_attn_interface as fa
from rdna_flash_attn.integrations.bert_padding import index_first_axis, pad_input, unpad_input

from .child_venv import venv_seeing_this_one
from .ring_checks import check_nan_lse_row

REPO_ROOT = Path(__file__).resolve().parent.parent
SHIM_DIR = REPO_ROOT / "rdna_flash_attn" / "integrations" / "flash_attn_shim"
REAL_FLASH_ATTN = autoload.real_flash_attn()

INF = float("inf")


# --- the reference: flash-attn's documented semantics in float64 ---------------------------------------


def reference(q, k, v, scale=None, causal=False, window=(-1, -1), alibi=None):
    """(out (B, Sq, H, D), lse (B, H, Sq)) in float64: causal masks and windows aligned to the
    bottom-right corner, ALiBi bias -slope * |i + Sk - Sq - j|, key/value head j serving query heads
    j * group ... (j + 1) * group - 1, rows that see no key give zeros and lse +inf."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    sq, sk = q.shape[2], k.shape[2]
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    diagonal = torch.arange(sq)[:, None] + sk - sq
    keys = torch.arange(sk)[None, :]
    if alibi is not None:
        scores = scores - alibi.double().reshape(*alibi.shape, 1, 1) * (diagonal - keys).abs()
    left, right = window[0], 0 if causal else window[1]
    if left >= 0:
        scores = scores.masked_fill(keys < diagonal - left, -INF)
    if right >= 0:
        scores = scores.masked_fill(keys > diagonal + right, -INF)
    lse = scores.logsumexp(-1)
    out = scores.softmax(-1).nan_to_num(0.0) @ v
    return out.transpose(1, 2), lse.masked_fill(lse == -INF, INF)


def varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi=None, **kwargs):
    """reference() per entry of a packed batch; rows of entries without keys are zeros."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    offsets_q, offsets_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(offsets_q) - 1):
        rows, keys = slice(offsets_q[b], offsets_q[b + 1]), slice(offsets_k[b], offsets_k[b + 1])
        if rows.stop > rows.start and keys.stop > keys.start:
            slopes = alibi[b] if alibi is not None and alibi.dim() == 2 else alibi
            out[rows] = reference(q[None, rows], k[None, keys], v[None, keys], alibi=slopes, **kwargs)[0][0]
    return out


def tolerance(dtype):
    return dict(atol={torch.float16: 2e-3, torch.bfloat16: 1.5e-2}.get(dtype, 1e-5), rtol=0)


def bshd(batch=2, q_len=24, k_len=24, heads=4, kv_heads=4, dim=64, dtype=torch.float16, seed=1, **kwargs):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, n, h, dim, generator=gen, dtype=dtype, **kwargs)
            for n, h in ((q_len, heads), (k_len, kv_heads), (k_len, kv_heads))]


def packed(lengths_q, lengths_k, heads=4, kv_heads=4, dim=64, dtype=torch.float16, seed=2, **kwargs):
    """(q, k, v, cu_seqlens_q, cu_seqlens_k) of a packed batch with these entry lengths."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), heads, dim, generator=gen, dtype=dtype, **kwargs)
    k, v = (torch.randn(sum(lengths_k), kv_heads, dim, generator=gen, dtype=dtype, **kwargs) for _ in range(2))
    cu_q, cu_k = (F.pad(torch.tensor(n).cumsum(0), (1, 0)).to(torch.int32) for n in (lengths_q, lengths_k))
    return q, k, v, cu_q, cu_k


def kernel_calls():
    return rfa.stats()["kernel"]


# --- flash_attn_func and the packed dense forms ---------------------------------------------------------


@pytest.mark.parametrize(
    "shape, kwargs, on_kernels",
    [
        ({}, {}, True),
        ({}, {"causal": True}, True),
        ({}, {"softmax_scale": 0.2}, True),
        ({"q_len": 10, "k_len": 30}, {"causal": True}, True),  # bottom-right: a bool mask
        ({"q_len": 30, "k_len": 10}, {"causal": True}, True),  # the first rows see no key: zeros
        ({"q_len": 1, "k_len": 30}, {"causal": True}, True),  # one row sees every key: no mask
        ({}, {"window_size": (4, 2)}, True),
        ({}, {"window_size": (3, -1), "causal": True}, True),
        ({}, {"window_size": (-1, 0)}, True),  # the same as causal
        ({"q_len": 40, "k_len": 12}, {"window_size": (2, 3)}, True),
        ({"heads": 8, "kv_heads": 2}, {}, True),  # GQA: enable_gqa, no repeated heads
        ({"heads": 8, "kv_heads": 1}, {"causal": True}, True),  # MQA
        ({"heads": 8, "kv_heads": 2, "q_len": 30, "k_len": 10}, {"causal": True, "window_size": (5, -1)}, True),
        ({"dim": 256, "q_len": 30, "k_len": 10}, {"causal": True}, False),  # masked kernels stop at 224
        ({"dim": 256, "heads": 8, "kv_heads": 2}, {"window_size": (3, 3)}, False),  # SDPA, heads repeated
    ],
)
def test_flash_attn_func_matches_flash_attn_semantics(fake_gpu, shape, kwargs, on_kernels):
    q, k, v = bshd(**shape)
    out = fa.flash_attn_func(q, k, v, **kwargs)
    expected, _ = reference(q, k, v, kwargs.get("softmax_scale"), kwargs.get("causal", False),
                            kwargs.get("window_size", (-1, -1)))
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    torch.testing.assert_close(out.double(), expected, **tolerance(q.dtype))
    assert (kernel_calls() == 1) is on_kernels, rfa.stats()


def test_flash_attn_func_rows_without_keys_are_zeros_on_sdpa_too():
    # On the CPU every call falls back; the rows that see no key are left out of SDPA.
    q, k, v = bshd(q_len=30, k_len=10, dtype=torch.float32, requires_grad=True)
    out = fa.flash_attn_func(q, k, v, causal=True)
    assert rfa.stats()["fallback"] == 1 and torch.equal(out[:, :20], torch.zeros_like(out[:, :20]))
    torch.testing.assert_close(out.double(), reference(q, k, v, causal=True)[0], **tolerance(q.dtype))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("slopes_shape", [(4,), (2, 4)])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_alibi_runs_on_the_kernels_as_a_bias(fake_gpu, slopes_shape, causal):
    q, k, v = bshd(q_len=12, k_len=20)
    slopes = torch.rand(slopes_shape, generator=torch.Generator().manual_seed(2)) * 0.5
    out = fa.flash_attn_func(q, k, v, alibi_slopes=slopes, causal=causal)
    torch.testing.assert_close(out.double(), reference(q, k, v, causal=causal, alibi=slopes)[0], **tolerance(q.dtype))
    assert kernel_calls() == 1


def test_flash_attn_func_passes_views_not_copies(fake_gpu):
    q, k, v = bshd(heads=8, kv_heads=2)
    fa.flash_attn_func(q, k, v)
    launched_q, launched_k = fake_gpu.launches[0][:2]
    assert launched_q.data_ptr() == q.data_ptr() and launched_q.shape == (2, 8, 24, 64)
    assert launched_k.data_ptr() == k.data_ptr() and launched_k.shape == (2, 2, 24, 64)


def test_flash_attn_func_dropout_and_fp32_fall_back(fake_gpu):
    q, k, v = bshd(dtype=torch.float32)
    out = fa.flash_attn_func(q, k, v)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), reference(q, k, v)[0], **tolerance(q.dtype))
    dropped = fa.flash_attn_func(*bshd(heads=8, kv_heads=2), dropout_p=0.5, causal=True)
    assert dropped.shape == (2, 24, 8, 64) and torch.isfinite(dropped).all()
    assert kernel_calls() == 0 and rfa.stats()["fallback"] == 2
    assert "dropout_p is not 0" in rfa.stats()["fallback_reasons"]


def test_flash_attn_func_gradients_match_the_reference(fake_gpu):
    q, k, v = bshd(q_len=10, k_len=16, heads=4, kv_heads=2, requires_grad=True)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3), dtype=q.dtype)
    fa.flash_attn_func(q, k, v, causal=True).backward(dout)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    reference(*leaves, causal=True)[0].backward(dout.double())
    assert kernel_calls() == 1 and fake_gpu.differentiable_launches == 1
    for t, expected in zip((q, k, v), leaves):
        torch.testing.assert_close(t.grad.double(), expected.grad, atol=1e-2, rtol=0)


def test_packed_dense_forms_equal_flash_attn_func(fake_gpu):
    q, k, v = bshd(heads=4, kv_heads=2)
    expected = fa.flash_attn_func(q, k, v, causal=True)
    kv = torch.stack([k, v], dim=2)
    torch.testing.assert_close(fa.flash_attn_kvpacked_func(q, kv, causal=True), expected)
    q, k, v = bshd()
    qkv = torch.stack([q, k, v], dim=2)
    torch.testing.assert_close(fa.flash_attn_qkvpacked_func(qkv, 0.0, None, True), fa.flash_attn_func(q, k, v, causal=True))
    assert kernel_calls() == 4


# --- the varlen functions -------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_varlen_runs_on_the_varlen_kernels(fake_gpu, causal, kv_heads):
    lengths_q, lengths_k = [5, 0, 17, 9, 3], [11, 4, 17, 0, 8]  # an entry without queries, one without keys
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, kv_heads=kv_heads)
    out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    torch.testing.assert_close(out.double(), varlen_reference(q, k, v, cu_q, cu_k, causal=causal), **tolerance(q.dtype))
    assert fake_gpu.varlen_launches == 1 and kernel_calls() == 1


@pytest.mark.parametrize("kwargs", [
    {"window_size": (3, 2)},
    {"window_size": (4, -1), "causal": True},
    {"alibi_slopes": "per head"},
    {"alibi_slopes": "per entry and head", "causal": True},
])
def test_varlen_windows_and_alibi_run_entry_by_entry_on_the_kernels(fake_gpu, kwargs):
    lengths_q, lengths_k = [6, 0, 14, 9], [10, 3, 14, 0]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k)
    gen = torch.Generator().manual_seed(4)
    slopes = {"per head": torch.rand(4, generator=gen), "per entry and head": torch.rand(4, 4, generator=gen)}
    kwargs = {name: slopes.get(value, value) if name == "alibi_slopes" else value for name, value in kwargs.items()}
    out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 14, 14, **kwargs)
    expected = varlen_reference(q, k, v, cu_q, cu_k, kwargs.get("alibi_slopes"), causal=kwargs.get("causal", False),
                                window=kwargs.get("window_size", (-1, -1)))
    torch.testing.assert_close(out.double(), expected, **tolerance(q.dtype))
    assert fake_gpu.varlen_launches == 0 and kernel_calls() == 2  # the two entries with queries and keys


def test_varlen_falls_back_entry_by_entry_where_the_kernels_refuse():
    q, k, v, cu_q, cu_k = packed([7, 12], [9, 12], kv_heads=2, dtype=torch.float32)
    out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 12, causal=True)
    torch.testing.assert_close(out.double(), varlen_reference(q, k, v, cu_q, cu_k, causal=True), **tolerance(q.dtype))
    assert kernel_calls() == 0 and rfa.stats()["fallback"] == 3  # the packed batch, then each entry


def test_varlen_dropout_falls_back_entry_by_entry(fake_gpu):
    q, k, v, cu_q, cu_k = packed([7, 12], [9, 12])
    out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 12, 0.3)
    assert out.shape == q.shape and torch.isfinite(out).all()
    assert fake_gpu.varlen_launches == 0 and rfa.stats()["fallback"] == 2


def test_varlen_takes_max_seqlen_as_a_tensor_and_packed_forms(fake_gpu):
    q, k, v, cu_q, cu_k = packed([7, 12], [9, 12], kv_heads=2)
    expected = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 12, causal=True)
    as_tensors = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, torch.tensor(12), torch.tensor(12), causal=True)
    kvpacked = fa.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], 1), cu_q, cu_k, 12, 12, causal=True)
    assert torch.equal(as_tensors, expected)
    torch.testing.assert_close(kvpacked, expected)
    q, k, v, cu, _ = packed([7, 12], [7, 12])
    qkvpacked = fa.flash_attn_varlen_qkvpacked_func(torch.stack([q, k, v], 1), cu, 12)
    torch.testing.assert_close(qkvpacked.double(), varlen_reference(q, k, v, cu, cu), **tolerance(q.dtype))
    assert fake_gpu.varlen_launches == 4


@pytest.mark.parametrize("window_size", [(-1, -1), (3, 3)])  # the varlen kernels, then entry by entry
def test_varlen_gradients_match_the_reference(fake_gpu, window_size):
    q, k, v, cu_q, cu_k = packed([6, 11], [9, 11], kv_heads=2, requires_grad=True)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5), dtype=q.dtype)
    fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 11, 11, causal=True, window_size=window_size).backward(dout)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    varlen_reference(*leaves, cu_q, cu_k, causal=True, window=window_size).backward(dout.double())
    assert kernel_calls() >= 1
    for t, expected in zip((q, k, v), leaves):
        torch.testing.assert_close(t.grad.double(), expected.grad, atol=1e-2, rtol=0)


# --- flash-attn's semantics on every path: softmax_lse, rows without keys, ALiBi, determinism ---------------


def varlen_reference_lse(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi=None, **kwargs):
    """reference()'s lse per entry of a packed batch, (heads, total_q): +inf for rows of entries without keys."""
    lse = torch.full((q.shape[1], q.shape[0]), INF, dtype=torch.float64)
    offsets_q, offsets_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(offsets_q) - 1):
        rows, keys = slice(offsets_q[b], offsets_q[b + 1]), slice(offsets_k[b], offsets_k[b + 1])
        if rows.stop > rows.start and keys.stop > keys.start:
            slopes = alibi[b] if alibi is not None and alibi.dim() == 2 else alibi
            lse[:, rows] = reference(q[None, rows], k[None, keys], v[None, keys], alibi=slopes, **kwargs)[1][0]
    return lse


@pytest.mark.parametrize("dim, on_kernels", [(64, True), (59, False)])  # the kernels take no head dim 59
@pytest.mark.parametrize("kwargs", [{"causal": True}, {"window_size": (3, 2)}, {"alibi_slopes": "per head"}])
def test_return_attn_probs_gives_out_softmax_lse_and_none(fake_gpu, dim, on_kernels, kwargs):
    q, k, v = bshd(q_len=30, k_len=12, dim=dim, requires_grad=True)  # the first rows see no key when causal
    if "alibi_slopes" in kwargs:
        kwargs = dict(kwargs, alibi_slopes=torch.rand(4, generator=torch.Generator().manual_seed(7)))
    out, lse, s_dmask = fa.flash_attn_func(q, k, v, return_attn_probs=True, **kwargs)
    expected_out, expected_lse = reference(q, k, v, causal=kwargs.get("causal", False),
                                           window=kwargs.get("window_size", (-1, -1)), alibi=kwargs.get("alibi_slopes"))
    assert s_dmask is None and lse.dtype == torch.float32 and lse.shape == (2, 4, 30) and not lse.requires_grad
    torch.testing.assert_close(out.double(), expected_out, **tolerance(q.dtype))
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-3, rtol=0)  # +inf where expected
    assert (kernel_calls() == 1) is on_kernels
    out.sum().backward()  # differentiable through out
    assert torch.isfinite(q.grad).all()


@pytest.mark.parametrize("function", ["flash_attn_qkvpacked_func", "flash_attn_kvpacked_func"])
def test_packed_dense_forms_return_attn_probs(fake_gpu, function):
    out, lse, s_dmask = dense_call(function)(causal=True, return_attn_probs=True)
    q, k, v = bshd()
    expected_out, expected_lse = reference(q, k, v, causal=True)
    torch.testing.assert_close(out.double(), expected_out, **tolerance(q.dtype))
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-3, rtol=0)
    assert s_dmask is None


@pytest.mark.parametrize("kwargs, varlen_launches", [({"causal": True}, 1), ({"window_size": (3, 2)}, 0)])
@pytest.mark.parametrize("dim", [64, 59])
def test_varlen_return_attn_probs_gives_heads_by_total_q_lse(fake_gpu, kwargs, varlen_launches, dim):
    lengths_q, lengths_k = [5, 0, 17, 9, 3], [11, 4, 17, 0, 8]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, dim=dim)
    out, lse, s_dmask = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 17, 17, return_attn_probs=True, **kwargs)
    reference_kwargs = dict(causal=kwargs.get("causal", False), window=kwargs.get("window_size", (-1, -1)))
    assert s_dmask is None and lse.dtype == torch.float32 and lse.shape == (4, q.shape[0])
    torch.testing.assert_close(out.double(), varlen_reference(q, k, v, cu_q, cu_k, **reference_kwargs),
                               **tolerance(q.dtype))
    torch.testing.assert_close(lse.double(), varlen_reference_lse(q, k, v, cu_q, cu_k, **reference_kwargs),
                               atol=1e-3, rtol=0)
    assert fake_gpu.varlen_launches == (varlen_launches if dim == 64 else 0)
    qkv_out, qkv_lse, _ = fa.flash_attn_varlen_qkvpacked_func(torch.stack([q, q, q], 1), cu_q, 17,
                                                               return_attn_probs=True)
    assert qkv_lse.shape == (4, q.shape[0]) and qkv_out.shape == q.shape


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fallback_rows_without_keys_give_zeros_and_zero_gradients(dtype):
    # On the CPU every call falls back: dense rows without keys, and an entry whose every row has none.
    q, k, v = bshd(q_len=30, k_len=10, dim=59, dtype=dtype, requires_grad=True)
    out = fa.flash_attn_func(q, k, v, window_size=(4, 2))
    assert not out[:, :18].any()
    torch.testing.assert_close(out.double(), reference(q, k, v, window=(4, 2))[0], **tolerance(dtype))
    out.sum().backward()
    assert not q.grad[:, :18].any() and all(torch.isfinite(t.grad).all() for t in (q, k, v))
    q, k, v, cu_q, cu_k = packed([9, 6], [3, 6], dim=59, dtype=dtype, requires_grad=True)
    out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 6, causal=True)
    torch.testing.assert_close(out.double(), varlen_reference(q, k, v, cu_q, cu_k, causal=True), **tolerance(dtype))
    out.sum().backward()
    assert not out[:6].any() and not q.grad[:6].any() and all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_fallback_alibi_meets_half_precision_queries(dtype, causal):
    q, k, v = bshd(q_len=40, k_len=300, dim=59, dtype=dtype, requires_grad=True)
    slopes = torch.rand(2, 4, generator=torch.Generator().manual_seed(8)) * 0.3
    out = fa.flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes)
    assert out.dtype == dtype and rfa.stats()["fallback"] == 1
    torch.testing.assert_close(out.double(), reference(q, k, v, causal=causal, alibi=slopes)[0], **tolerance(dtype))
    out.sum().backward()
    assert q.grad.dtype == dtype and torch.isfinite(q.grad).all()


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_holds_the_sdpa_fallback_to_its_math_backend(monkeypatch, deterministic):
    backends = []

    def recording_sdpa(*args, **kwargs):
        backends.append((torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                         torch.backends.cuda.math_sdp_enabled()))
        return torch_sdpa(*args, **kwargs)

    torch_sdpa = fa.router.torch_sdpa
    monkeypatch.setattr(fa.router, "torch_sdpa", recording_sdpa)
    q, k, v = bshd(dim=59)
    fa.flash_attn_func(q, k, v, causal=True, deterministic=deterministic)
    q, k, v, cu_q, cu_k = packed([7, 12], [9, 12], dim=59)
    fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 12, 12, deterministic=deterministic)
    assert len(backends) == 3
    assert all(used == ((False, False, True) if deterministic else (True, True, True)) for used in backends)


@pytest.mark.parametrize("kwargs", [{"causal": True}, {"window_size_left": 3, "window_size_right": 2},
                                    {"alibi_slopes": "per entry and head", "causal": True}])
def test_private_varlen_pair_matches_the_reference(fake_gpu, kwargs):
    lengths_q, lengths_k = [6, 0, 11, 9], [9, 3, 11, 0]
    q, k, v, cu_q, cu_k = packed(lengths_q, lengths_k, kv_heads=2)
    slopes = torch.rand(4, 4, generator=torch.Generator().manual_seed(9))
    call = dict(causal=False, window_size_left=-1, window_size_right=-1, alibi_slopes=None)
    call.update({name: slopes if value == "per entry and head" else value for name, value in kwargs.items()})
    window = (call["window_size_left"], call["window_size_right"])
    reference_kwargs = dict(causal=call["causal"], window=window, alibi=call["alibi_slopes"])
    out, lse, s_dmask, rng_state = fa._flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 11, 11, 0.0, None, **call)
    torch.testing.assert_close(out.double(), varlen_reference(q, k, v, cu_q, cu_k, **reference_kwargs),
                               **tolerance(q.dtype))
    torch.testing.assert_close(lse.double(), varlen_reference_lse(q, k, v, cu_q, cu_k, **reference_kwargs),
                               atol=1e-3, rtol=0)
    assert s_dmask.numel() == 0 and rng_state.dtype == torch.int64

    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(10), dtype=q.dtype)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    softmax_d = fa._flash_attn_varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, 11, 11, 0.0, None,
                                               call["causal"], *window, 0.0, call["alibi_slopes"], False)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    varlen_reference(*leaves, cu_q, cu_k, **reference_kwargs).backward(dout.double())
    for grad, expected in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(grad.double(), expected.grad, atol=1e-2, rtol=0)
    rowsum = (dout.double() * out.double()).sum(-1).T  # (heads, total_q)
    assert softmax_d.shape == (4, q.shape[0] + 128 * 4)
    for b, (start, stop) in enumerate(zip(cu_q.tolist(), cu_q.tolist()[1:])):
        expected = rowsum[:, start:stop] if lengths_k[b] else torch.zeros(4, stop - start, dtype=torch.float64)
        torch.testing.assert_close(softmax_d[:, start + 128 * b:stop + 128 * b].double(), expected, atol=1e-2, rtol=0)


def test_private_varlen_pair_refuses_what_it_cannot_do():
    q, k, v, cu, _ = packed([5, 7], [5, 7])
    for kwargs, named in (({"dropout_p": 0.1}, "dropout_p"), ({"return_softmax": True}, "return_softmax"),
                          ({"seqused_k": cu[1:]}, "seqused_k"), ({"softcap": 5.0}, "softcap")):
        with pytest.raises(NotImplementedError, match=named):
            fa._flash_attn_varlen_forward(q, k, v, cu, cu, 7, 7, **dict({"dropout_p": 0.0, "softmax_scale": None,
                                                                          "causal": False}, **kwargs))


# --- what flash-attn does not offer here, and argument errors ---------------------------------------------


def dense_call(function):
    q, k, v = bshd()
    return {
        "flash_attn_func": lambda **kw: fa.flash_attn_func(q, k, v, **kw),
        "flash_attn_qkvpacked_func": lambda **kw: fa.flash_attn_qkvpacked_func(torch.stack([q, k, v], 2), **kw),
        "flash_attn_kvpacked_func": lambda **kw: fa.flash_attn_kvpacked_func(q, torch.stack([k, v], 2), **kw),
    }[function]


def varlen_call(function):
    q, k, v, cu, _ = packed([5, 7], [5, 7])
    return {
        "flash_attn_varlen_func": lambda **kw: fa.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, **kw),
        "flash_attn_varlen_qkvpacked_func":
            lambda **kw: fa.flash_attn_varlen_qkvpacked_func(torch.stack([q, k, v], 1), cu, 7, **kw),
        "flash_attn_varlen_kvpacked_func":
            lambda **kw: fa.flash_attn_varlen_kvpacked_func(q, torch.stack([k, v], 1), cu, cu, 7, 7, **kw),
    }[function]


@pytest.mark.parametrize("call", [dense_call("flash_attn_func"), dense_call("flash_attn_qkvpacked_func"),
                                  dense_call("flash_attn_kvpacked_func"), varlen_call("flash_attn_varlen_func"),
                                  varlen_call("flash_attn_varlen_qkvpacked_func"),
                                  varlen_call("flash_attn_varlen_kvpacked_func")])
@pytest.mark.parametrize("kwargs, named", [({"return_attn_probs": True, "dropout_p": 0.5}, "return_attn_probs"),
                                           ({"softcap": 30.0}, "softcap")])
def test_unsupported_features_raise_not_implemented(call, kwargs, named):
    with pytest.raises(NotImplementedError, match=named):
        call(**kwargs)


def test_a_paged_kv_cache_raises_not_implemented():
    with pytest.raises(NotImplementedError, match="block_table"):
        varlen_call("flash_attn_varlen_func")(block_table=torch.zeros(2, 1, dtype=torch.int32))


def test_argument_errors_are_named():
    q, k, v = bshd()
    with pytest.raises(ValueError, match="head dims of q, k and v differ"):
        fa.flash_attn_func(q, k, v[..., :32])
    with pytest.raises(ValueError, match="must divide the heads of q"):
        fa.flash_attn_func(*bshd(heads=4, kv_heads=3))
    with pytest.raises(ValueError, match="alibi_slopes"):
        fa.flash_attn_func(q, k, v, alibi_slopes=torch.ones(3))
    q, k, v, cu, _ = packed([5, 7], [5, 7])
    with pytest.raises(ValueError, match="int32"):
        fa.flash_attn_varlen_func(q, k, v, cu.long(), cu, 7, 7)


# --- real call sites ------------------------------------------------------------------------------------


@pytest.fixture
def no_cached_flash_attn(monkeypatch):
    """No `flash_attn` module imported before the test, none left after it."""
    def cached():
        return [name for name in sys.modules if name == "flash_attn" or name.startswith("flash_attn.")]

    for name in cached():
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in cached():
        del sys.modules[name]


@pytest.fixture
def flash_attn(no_cached_flash_attn, monkeypatch):
    """`import flash_attn` as the opt-in gives it: the stand-in, first on sys.path."""
    monkeypatch.syspath_prepend(str(SHIM_DIR))
    return importlib.import_module("flash_attn")


def padded_segments(valid_lengths, seqlen):
    """cu_seqlens with 2B+1 entries: each sample's valid tokens, then its padding as its own segment."""
    offsets = [0]
    for b, valid in enumerate(valid_lengths):
        offsets += [b * seqlen + valid, (b + 1) * seqlen]
    return torch.tensor(offsets, dtype=torch.int32)


def test_hunyuan_video_varlen_with_padding_segments(fake_gpu, flash_attn):
    from flash_attn.flash_attn_interface import flash_attn_varlen_func

    batch, seqlen, heads, dim = 2, 48, 24, 128
    x = [t.to(torch.bfloat16) for t in bshd(batch, seqlen, seqlen, heads, heads, dim, dtype=torch.float32)]
    q, k, v = (t.view(batch * seqlen, heads, dim) for t in x)
    cu_seqlens_q = cu_seqlens_kv = padded_segments([40, 33], seqlen)
    max_seqlen_q = max_seqlen_kv = seqlen
    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv)
    out = out.view(batch, max_seqlen_q, heads, dim)
    expected = varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_kv).view(batch, seqlen, heads, dim)
    torch.testing.assert_close(out.double(), expected, **tolerance(torch.bfloat16))
    assert fake_gpu.varlen_launches == 1 and kernel_calls() == 1


def test_hunyuan_video_xdit_private_forward(fake_gpu, flash_attn):
    from flash_attn.flash_attn_interface import _flash_attn_forward

    q, k, v = bshd(1, 40, 40, 8, 8, 128, dtype=torch.bfloat16)
    assert flash_attn.__version__ >= "2.7.0"
    attn2, *_ = _flash_attn_forward(q, k, v, dropout_p=0.0, softmax_scale=q.shape[-1] ** (-0.5), causal=False,
                                    window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                                    return_softmax=False)
    torch.testing.assert_close(attn2.double(), reference(q, k, v)[0], **tolerance(q.dtype))
    assert len(fake_gpu.launches) == 1


def test_hunyuan_image_unpad_qkvpacked_varlen_pad(fake_gpu, flash_attn):
    einops = pytest.importorskip("einops")
    from flash_attn.bert_padding import pad_input, unpad_input
    from flash_attn.flash_attn_interface import flash_attn_varlen_qkvpacked_func

    batch_size, seqlen, heads, dim = 2, 32, 8, 64
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(batch_size, seqlen, 3 * heads * dim, generator=gen).half()
    key_padding_mask = torch.arange(seqlen)[None, :] < torch.tensor([[29], [17]])
    dropout_p, softmax_scale, causal, deterministic = 0.0, None, False, False

    x_unpad, indices, cu_seqlens, max_s = unpad_input(x, key_padding_mask)[:4]
    x_unpad = einops.rearrange(x_unpad, "nnz (three h d) -> nnz three h d", three=3, h=heads)
    output_unpad = flash_attn_varlen_qkvpacked_func(x_unpad, cu_seqlens, max_s, dropout_p,
                                                    softmax_scale=softmax_scale, causal=causal,
                                                    deterministic=deterministic)
    if isinstance(output_unpad, tuple):
        output_unpad = output_unpad[0]
    output = pad_input(einops.rearrange(output_unpad, "nnz h d -> nnz (h d)"), indices, batch_size, seqlen)

    assert output.shape == (batch_size, seqlen, heads * dim)
    q, k, v = x.view(batch_size, seqlen, 3, heads, dim).unbind(2)
    for b, valid in enumerate((29, 17)):
        expected = reference(q[b:b + 1, :valid], k[b:b + 1, :valid], v[b:b + 1, :valid])[0]
        torch.testing.assert_close(output[b:b + 1, :valid].double(), expected.flatten(-2), **tolerance(q.dtype))
        assert not output[b, valid:].any()
    assert fake_gpu.varlen_launches == 1


def test_hidream_flash_attn_func(fake_gpu, flash_attn):
    query, key, value = bshd(1, 32, 32, 20, 20, 128, dtype=torch.bfloat16)
    hidden_states = flash_attn.flash_attn_func(query, key, value, dropout_p=0., causal=False)
    hidden_states = hidden_states.flatten(-2)
    assert hidden_states.shape == (1, 32, 20 * 128)
    torch.testing.assert_close(hidden_states.double(), reference(query, key, value)[0].flatten(-2),
                               **tolerance(query.dtype))
    assert kernel_calls() == 1


def test_sd_scripts_per_sample_dense_and_varlen_calls(fake_gpu, flash_attn):
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    batch, seqlen, heads, dim, drop_rate = 2, 40, 8, 64, 0.0
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(batch, seqlen, 3, heads, dim, generator=gen).to(torch.bfloat16)
    q, k, v = qkv.unbind(2)  # (B, L, H, D) views into the packed projection: not contiguous
    lengths = [33, 21]
    for i, length in enumerate(lengths):
        x = flash_attn_func(q[i:i + 1, :length], k[i:i + 1, :length], v[i:i + 1, :length], drop_rate)
        expected = reference(q[i:i + 1, :length], k[i:i + 1, :length], v[i:i + 1, :length])[0]
        torch.testing.assert_close(x.double(), expected, **tolerance(q.dtype))
    whole = flash_attn_func(q, k, v, drop_rate)
    torch.testing.assert_close(whole.double(), reference(q, k, v)[0], **tolerance(q.dtype))
    assert kernel_calls() == 3

    q, k, v = (t.reshape(batch * seqlen, heads, dim) for t in (q, k, v))
    cu_seqlens, max_seqlen = padded_segments(lengths, seqlen), seqlen
    x = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, drop_rate)
    x = x.view(batch, seqlen, heads, dim)
    expected = varlen_reference(q, k, v, cu_seqlens, cu_seqlens).view(batch, seqlen, heads, dim)
    torch.testing.assert_close(x.double(), expected, **tolerance(q.dtype))
    assert fake_gpu.varlen_launches == 1


def test_lumina2_and_omnigen2_unpad_gqa_varlen_pad(fake_gpu, flash_attn):
    from flash_attn import flash_attn_varlen_func
    from flash_attn.bert_padding import index_first_axis, pad_input
    from flash_attn.ops.activations import swiglu

    # OmniGen2's checks before it uses flash-attn.
    assert importlib.util.find_spec("flash_attn") is not None
    assert importlib.metadata.version("flash_attn") == "2.8.3"
    x, y = torch.randn(2, 5), torch.randn(2, 5)
    torch.testing.assert_close(swiglu(x, y), F.silu(x) * y)

    bsz, seqlen, n_heads, n_kv_heads, head_dim = 2, 40, 24, 8, 96
    query, key, value = bshd(bsz, seqlen, seqlen, n_heads, n_kv_heads, head_dim, dtype=torch.bfloat16)
    attention_mask = torch.arange(seqlen)[None, :] < torch.tensor([[40], [26]])
    softmax_scale = head_dim ** -0.5

    seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices_k = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch_k = seqlens_in_batch.max().item()
    cu_seqlens_k = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    key_states = index_first_axis(key.reshape(bsz * seqlen, n_kv_heads, head_dim), indices_k)
    value_states = index_first_axis(value.reshape(bsz * seqlen, n_kv_heads, head_dim), indices_k)
    query_states = index_first_axis(query.reshape(bsz * seqlen, n_heads, head_dim), indices_k)
    indices_q, cu_seqlens_q, max_seqlen_in_batch_q = indices_k, cu_seqlens_k, max_seqlen_in_batch_k

    attn_output_unpad = flash_attn_varlen_func(
        query_states, key_states, value_states, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_in_batch_q, max_seqlen_k=max_seqlen_in_batch_k, dropout_p=0.0, causal=False,
        softmax_scale=softmax_scale,
    )
    output = pad_input(attn_output_unpad, indices_q, bsz, seqlen).flatten(-2)

    assert output.shape == (bsz, seqlen, n_heads * head_dim)
    for b, valid in enumerate((40, 26)):
        expected = reference(query[b:b + 1, :valid], key[b:b + 1, :valid], value[b:b + 1, :valid])[0]
        torch.testing.assert_close(output[b:b + 1, :valid].double(), expected.flatten(-2), **tolerance(query.dtype))
    assert fake_gpu.varlen_launches == 1 and fake_gpu.launches == []  # GQA passed straight to the varlen kernels


def test_wan_keyword_varlen_with_padded_max_seqlen_k(fake_gpu, flash_attn):
    b, lq, lk, n, c = 2, 24, 30, 12, 128
    q, k, v = bshd(b, lq, lk, n, n, c, dtype=torch.bfloat16)
    q_lens = torch.tensor([lq, lq], dtype=torch.int32)
    k_lens = torch.tensor([26, 19], dtype=torch.int32)  # both padded to lk, which Wan passes as max_seqlen_k
    dropout_p, softmax_scale, causal, window_size, deterministic = 0.0, None, False, (-1, -1), False

    x = flash_attn.flash_attn_varlen_func(
        q=q.flatten(0, 1),
        k=torch.cat([u[:length] for u, length in zip(k, k_lens)]),
        v=torch.cat([u[:length] for u, length in zip(v, k_lens)]),
        cu_seqlens_q=torch.cat([q_lens.new_zeros([1]), q_lens]).cumsum(0, dtype=torch.int32).to(q.device,
                                                                                                non_blocking=True),
        cu_seqlens_k=torch.cat([k_lens.new_zeros([1]), k_lens]).cumsum(0, dtype=torch.int32).to(q.device,
                                                                                                non_blocking=True),
        max_seqlen_q=lq,
        max_seqlen_k=lk,
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        deterministic=deterministic,
    ).unflatten(0, (b, lq))

    assert x.shape == (b, lq, n, c)
    for i, length in enumerate(k_lens.tolist()):
        expected = reference(q[i:i + 1], k[i:i + 1, :length], v[i:i + 1, :length])[0]
        torch.testing.assert_close(x[i:i + 1].double(), expected, **tolerance(q.dtype))
    assert fake_gpu.varlen_launches == 1

    # Wan2.2's face blocks.
    face = flash_attn.flash_attn_func(q, k, v)
    torch.testing.assert_close(face.double(), reference(q, k, v)[0], **tolerance(q.dtype))
    assert kernel_calls() == 2


def test_diffusers_call_patterns(fake_gpu, flash_attn):
    from flash_attn import flash_attn_func, flash_attn_varlen_func
    from flash_attn.flash_attn_interface import _wrapped_flash_attn_backward, _wrapped_flash_attn_forward

    batch_size, seqlen, heads, dim = 2, 20, 4, 64
    query, key, value = bshd(batch_size, seqlen, seqlen, heads, heads, dim)
    dropout_p, scale, is_causal, window_size, return_lse = 0.0, 0.1, True, (-1, -1), False
    out = flash_attn_func(q=query, k=key, v=value, dropout_p=dropout_p, softmax_scale=scale, causal=is_causal,
                          window_size=window_size, return_attn_probs=return_lse)
    torch.testing.assert_close(out.double(), reference(query, key, value, scale, causal=True)[0],
                               **tolerance(query.dtype))

    cu_seqlens = torch.tensor([0, seqlen, 2 * seqlen], dtype=torch.int32)
    out = flash_attn_varlen_func(q=query.flatten(0, 1), k=key.flatten(0, 1), v=value.flatten(0, 1),
                                 cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=seqlen,
                                 max_seqlen_k=seqlen, dropout_p=dropout_p, softmax_scale=scale, causal=is_causal,
                                 window_size=window_size, return_attn_probs=return_lse).unflatten(0, (batch_size, -1))
    torch.testing.assert_close(out.double(), reference(query, key, value, scale, causal=True)[0],
                               **tolerance(query.dtype))
    assert kernel_calls() == 2 and fake_gpu.varlen_launches == 1

    softcap, alibi_slopes, deterministic = 0.0, None, False
    launches = len(fake_gpu.launches)
    out, lse, S_dmask, rng_state = _wrapped_flash_attn_forward(query, key, value, dropout_p, scale, is_causal,
                                                               window_size[0], window_size[1], softcap, alibi_slopes,
                                                               return_lse)
    assert len(fake_gpu.launches) == launches + 1
    assert lse.shape == (batch_size, heads, seqlen) and S_dmask.numel() == 0
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(8), dtype=out.dtype)
    grad_q, grad_k, grad_v = (torch.empty_like(t) for t in (query, key, value))
    softmax_d = _wrapped_flash_attn_backward(grad_out, query, key, value, out, lse, grad_q, grad_k, grad_v,
                                             dropout_p, scale, is_causal, window_size[0], window_size[1], softcap,
                                             alibi_slopes, deterministic, rng_state)
    leaves = [t.detach().double().requires_grad_() for t in (query, key, value)]
    reference(*leaves, scale, causal=True)[0].backward(grad_out.double())
    for grad, expected in zip((grad_q, grad_k, grad_v), leaves):
        torch.testing.assert_close(grad.double(), expected.grad, atol=1e-2, rtol=0)
    assert softmax_d.shape == (batch_size, heads, 128)


def test_diffusers_flash_backend_runs_on_the_stand_in(tmp_path):
    pytest.importorskip("diffusers")
    code = textwrap.dedent("""
        import json, torch
        from diffusers.models import attention_dispatch as dispatch
        q, k, v = (torch.randn(1, 16, 2, 64, dtype=torch.bfloat16) for _ in range(3))
        out = dispatch.dispatch_attention_fn(q, k, v, backend=dispatch.AttentionBackendName.FLASH)
        ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2).float() for t in (q, k, v)))
        print(json.dumps(dict(usable=dispatch._CAN_USE_FLASH_ATTN, shape=list(out.shape),
                              error=(out.float() - ref.transpose(1, 2)).abs().max().item())))
    """)
    child = run_python(["-c", code], child_env([REPO_ROOT, SHIM_DIR], tmp_path), cwd=tmp_path)
    assert child.returncode == 0, child.stderr
    seen = json.loads(child.stdout.splitlines()[-1])
    assert seen["usable"] and seen["shape"] == [1, 16, 2, 64] and seen["error"] < 2e-2


# --- the private forward/backward pair --------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [{}, {"causal": True}, {"window_size": (3, 2)}, {"alibi": True, "causal": True}])
def test_private_forward_on_the_kernels_gives_flash_attn_lse(fake_gpu, kwargs):
    q, k, v = bshd(q_len=12, k_len=20, heads=4, kv_heads=2)
    slopes = torch.rand(4, generator=torch.Generator().manual_seed(9)) if kwargs.get("alibi") else None
    left, right = kwargs.get("window_size", (-1, -1))
    out, lse, s_dmask, rng_state = fa._flash_attn_forward(q, k, v, 0.0, None, kwargs.get("causal", False), left, right,
                                                          0.0, slopes, False)
    expected_out, expected_lse = reference(q, k, v, causal=kwargs.get("causal", False), window=(left, right),
                                           alibi=slopes)
    torch.testing.assert_close(out.double(), expected_out, **tolerance(q.dtype))
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-3, rtol=0)
    assert out.is_contiguous() and lse.dtype == torch.float32 and lse.is_contiguous()
    assert s_dmask.numel() == 0 and rng_state.shape == (2,) and rng_state.dtype == torch.int64
    assert len(fake_gpu.launches) == 1


def test_private_forward_computes_in_float32_math_where_the_kernels_refuse():
    q, k, v = bshd(q_len=30, k_len=10, heads=4, kv_heads=2, dtype=torch.float32)
    out, lse, *_ = fa._flash_attn_forward(q, k, v, 0.0, 0.3, True, 4, -1, 0.0, None, False)
    expected_out, expected_lse = reference(q, k, v, 0.3, causal=True, window=(4, -1))
    torch.testing.assert_close(out.double(), expected_out, **tolerance(q.dtype))
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-5, rtol=0)
    assert torch.isinf(lse[:, :, :20]).all() and not out[:, :20].any()  # rows that see no key


@pytest.mark.parametrize("kwargs", [{}, {"causal": True}, {"window_size": (2, 5)}, {"alibi": True}])
def test_private_backward_matches_autograd_of_the_reference(kwargs):
    q, k, v = bshd(q_len=14, k_len=22, heads=4, kv_heads=2, dtype=torch.float32)
    slopes = torch.rand(2, 4, generator=torch.Generator().manual_seed(10)) if kwargs.get("alibi") else None
    causal, (left, right) = kwargs.get("causal", False), kwargs.get("window_size", (-1, -1))
    out, lse, _, rng_state = fa._flash_attn_forward(q, k, v, 0.0, None, causal, left, right, 0.0, slopes, False)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(11))
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    softmax_d = fa._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, None, causal, left, right, 0.0,
                                        slopes, False, rng_state)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    reference(*leaves, causal=causal, window=(left, right), alibi=slopes)[0].backward(dout.double())
    for grad, expected in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(grad.double(), expected.grad, atol=1e-4, rtol=0)
    torch.testing.assert_close(softmax_d[:, :, :14], (dout * out).sum(-1).transpose(1, 2))
    assert softmax_d.shape == (2, 4, 128) and not softmax_d[:, :, 14:].any()


def test_private_backward_runs_on_the_kernels_from_the_given_out_and_lse(fake_gpu):
    # causal with more queries than keys: the first 8 rows see no key, and get zero gradients
    q, k, v = bshd(q_len=20, k_len=12, heads=4, kv_heads=2)
    out, lse, _, rng_state = fa._flash_attn_forward(q, k, v, 0.0, None, True, -1, -1, None, None, False)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(13)).half()
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    softmax_d = fa._flash_attn_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0, None, True, -1, -1, None, None,
                                        False, rng_state)
    assert fake_gpu.backward_from_output_launches == 1
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    reference(*leaves, causal=True)[0].backward(dout.double())
    for grad, expected in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(grad.double(), expected.grad, **tolerance(q.dtype))
    assert not dq[:, :8].any() and torch.isinf(lse[:, :, :8]).all()
    torch.testing.assert_close(softmax_d[:, :, :20], (dout.float() * out.float()).sum(-1).transpose(1, 2))


def test_private_backward_gives_nan_gradients_where_the_lse_is_nan():
    """Float32 inputs (the math path): a NaN lse is not a row without keys (tests/interpreter/
    test_ring_attention.py runs the same on the kernels)."""
    q, k, v = bshd(q_len=20, k_len=12, heads=2, kv_heads=2, dtype=torch.float32)
    out, lse, *_ = fa._flash_attn_forward(q, k, v, 0.0, None, False, -1, -1, 0.0, None, False)
    lse[1, 0, 5] = float("nan")
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(15))
    grads = [torch.empty_like(t) for t in (q, k, v)]
    fa._flash_attn_backward(dout, q, k, v, out, lse, *grads, 0.0, None, False, -1, -1, 0.0, None, False)
    check_nan_lse_row(*grads, batch=1, head=0, row=5)


@pytest.mark.parametrize("kernels", [False, True])
def test_private_backward_takes_either_infinite_lse_as_a_row_without_keys(kernels, request):
    # +inf is flash-attn's mark; -inf is what a log-sum-exp merge leaves: both give zero gradients there
    if kernels:
        request.getfixturevalue("fake_gpu")
    q, k, v = bshd(q_len=20, k_len=12, heads=4, kv_heads=2, dtype=torch.float16 if kernels else torch.float32)
    out, lse, *_ = fa._flash_attn_forward(q, k, v, 0.0, None, True, -1, -1, 0.0, None, False)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(14)).to(q.dtype)
    grads = []
    for marked in (lse, lse.masked_fill(torch.isinf(lse), -INF)):
        buffers = [torch.empty_like(t) for t in (q, k, v)]
        fa._flash_attn_backward(dout, q, k, v, out, marked, *buffers, 0.0, None, True, -1, -1, 0.0, None, False)
        grads.append(buffers)
    for with_plus, with_minus in zip(*grads):
        assert torch.isfinite(with_minus).all()
        torch.testing.assert_close(with_minus, with_plus, atol=0, rtol=0)
    assert not grads[1][0][:, :8].any()


def test_private_pair_supports_ring_attention_over_key_chunks():
    # diffusers' ring attention: a forward per key/value chunk, outputs merged by their lse, then a
    # backward per chunk with the merged out and lse; the chunks' gradients add up to the whole's.
    q, k, v = bshd(q_len=16, k_len=24, heads=4, kv_heads=2, dtype=torch.float32)
    chunks = [(k[:, :10], v[:, :10]), (k[:, 10:], v[:, 10:])]
    partial = [fa._flash_attn_forward(q, ck, cv, 0.0, None, False, -1, -1, 0.0, None, False)[:2] for ck, cv in chunks]
    lse = torch.logsumexp(torch.stack([chunk_lse for _, chunk_lse in partial]), 0)
    out = sum(chunk_out * (chunk_lse - lse).exp().transpose(1, 2)[..., None] for chunk_out, chunk_lse in partial)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(12))
    dq, dks, dvs = torch.zeros_like(q), [], []
    for ck, cv in chunks:
        chunk_dq, chunk_dk, chunk_dv = (torch.empty_like(t) for t in (q, ck, cv))
        fa._flash_attn_backward(dout, q, ck, cv, out, lse, chunk_dq, chunk_dk, chunk_dv, 0.0, None, False, -1, -1,
                                0.0, None, False)
        dq, dks, dvs = dq + chunk_dq, dks + [chunk_dk], dvs + [chunk_dv]
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    reference(*leaves)[0].backward(dout.double())
    for grad, expected in zip((dq, torch.cat(dks, 1), torch.cat(dvs, 1)), leaves):
        torch.testing.assert_close(grad.double(), expected.grad, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kwargs, named", [({"dropout_p": 0.1}, "dropout_p"), ({"softcap": 5.0}, "softcap"),
                                           ({"return_softmax": True}, "return_softmax")])
def test_private_forward_refuses_what_it_cannot_do(kwargs, named):
    q, k, v = bshd()
    arguments = dict(dropout_p=0.0, softmax_scale=None, causal=False, window_size_left=-1, window_size_right=-1,
                     softcap=0.0, alibi_slopes=None, return_softmax=False) | kwargs
    with pytest.raises(NotImplementedError, match=named):
        fa._flash_attn_forward(q, k, v, **arguments)


def test_private_names_are_flash_attns():
    assert fa._wrapped_flash_attn_forward is fa._flash_attn_forward
    assert fa._wrapped_flash_attn_backward is fa._flash_attn_backward


# --- bert_padding -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.int32])
def test_unpad_and_pad_round_trip_with_gradients(mask_dtype):
    hidden = torch.randn(3, 7, 5, requires_grad=True)
    attention_mask = (torch.arange(7)[None, :] < torch.tensor([[7], [2], [5]])).to(mask_dtype)
    unpadded, indices, cu_seqlens, max_seqlen, used = unpad_input(hidden, attention_mask)
    assert unpadded.shape == (14, 5) and indices.tolist() == [*range(7), 7, 8, *range(14, 19)]
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.tolist() == [0, 7, 9, 14]
    assert type(max_seqlen) is int and max_seqlen == 7
    assert used.dtype == torch.int32 and used.tolist() == [7, 2, 5]
    padded = pad_input(unpadded * 2, indices, 3, 7)
    assert torch.equal(padded, hidden.detach() * 2 * attention_mask.bool()[..., None])
    padded.sum().backward()
    assert torch.equal(hidden.grad, 2.0 * attention_mask.bool()[..., None].expand_as(hidden))


def test_unpad_input_counts_unused_tokens_in_the_segments_not_in_used_lengths():
    attention_mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]])
    unused_mask = torch.tensor([[0, 0, 1, 0], [0, 1, 1, 0]])
    _, indices, cu_seqlens, max_seqlen, used = unpad_input(torch.randn(2, 4, 3), attention_mask, unused_mask)
    assert indices.tolist() == [0, 1, 2, 4, 5, 6] and cu_seqlens.tolist() == [0, 3, 6]
    assert max_seqlen == 3 and used.tolist() == [2, 1]


def test_index_first_axis_picks_rows():
    rows = torch.arange(24.0).view(6, 2, 2)
    assert torch.equal(index_first_axis(rows, torch.tensor([4, 1])), rows[[4, 1]])


# --- the opt-in -----------------------------------------------------------------------------------------------


def child_env(pythonpath, cache_dir, **variables) -> dict[str, str]:
    """The environment for a child Python: this PYTHONPATH, no RDNA_FA_* variables but these and a
    private self-test cache."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("RDNA_FA_")}
    env.update(PYTHONPATH=os.pathsep.join(map(str, pythonpath)), RDNA_FA_CACHE_DIR=str(cache_dir / "cache"),
               **variables)
    return env


def run_python(args, env, python=sys.executable, cwd=None):
    return subprocess.run([str(python), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300,
                          check=False)


VERSION_PROBE = ("import importlib.metadata, flash_attn; "
                 "print(flash_attn.__version__, importlib.metadata.version('flash_attn'), flash_attn.__file__)")


def test_the_stand_in_on_sys_path_reports_flash_attn_2_8_3(tmp_path):
    env = child_env([REPO_ROOT, SHIM_DIR], tmp_path, RDNA_FA_FLASH_ATTN="1")
    child = run_python(["-c", VERSION_PROBE], env, cwd=tmp_path)
    assert child.returncode == 0, child.stderr
    version, metadata_version, location = child.stdout.split()
    assert version == metadata_version == "2.8.3" and Path(location).is_relative_to(SHIM_DIR)


@pytest.mark.skipif(REAL_FLASH_ATTN is not None, reason=f"a real flash-attn is installed ({REAL_FLASH_ATTN})")
def test_without_the_opt_in_there_is_no_flash_attn(tmp_path):
    child = run_python(["-c", "import flash_attn"], child_env([REPO_ROOT], tmp_path), cwd=tmp_path)
    assert child.returncode != 0 and "No module named 'flash_attn'" in child.stderr


@pytest.fixture(scope="module")
def hooked_python(tmp_path_factory):
    """A virtual environment (this one's packages visible, for torch) whose site-packages holds the .pth hook."""
    python, purelib = venv_seeing_this_one(tmp_path_factory.mktemp("venv"))
    (purelib / "rdna_flash_attn_autoload.pth").write_text((REPO_ROOT / "rdna_flash_attn_autoload.pth").read_text())
    return python


@pytest.mark.skipif(REAL_FLASH_ATTN is not None, reason=f"a real flash-attn is installed ({REAL_FLASH_ATTN})")
@pytest.mark.parametrize("opted_in", [True, False])
def test_the_pth_hook_provides_the_stand_in_only_on_request(hooked_python, tmp_path, opted_in):
    variables = {"RDNA_FA_FLASH_ATTN": "1"} if opted_in else {}
    child = run_python(["-c", VERSION_PROBE], child_env([REPO_ROOT], tmp_path, **variables), python=hooked_python,
                       cwd=tmp_path)
    if not opted_in:
        assert child.returncode != 0 and "No module named 'flash_attn'" in child.stderr
        return
    assert child.returncode == 0, child.stderr
    version, metadata_version, location = child.stdout.split()
    assert version == metadata_version == "2.8.3" and Path(location).is_relative_to(SHIM_DIR)
    assert child.stderr == ""


@pytest.fixture
def real_flash_attn_dir(tmp_path, no_cached_flash_attn, monkeypatch):
    """A folder holding a stand-in for an installed flash-attn, first on sys.path."""
    package = tmp_path / "site" / "flash_attn"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("__version__ = '2.6.3'\n")
    monkeypatch.syspath_prepend(str(package.parent))
    return package


def test_provide_flash_attn_never_shadows_an_installed_flash_attn(real_flash_attn_dir, monkeypatch, log_records):
    monkeypatch.setattr(sys, "path", list(sys.path))
    found = autoload.provide_flash_attn({"RDNA_FA_FLASH_ATTN": "1"})
    assert found == str(real_flash_attn_dir / "__init__.py")
    assert autoload.FLASH_ATTN_SHIM_DIR not in sys.path
    assert importlib.import_module("flash_attn").__version__ == "2.6.3"
    said = [r.getMessage() for r in log_records.records if "flash-attn is installed" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith(
        f"RDNA_FA_FLASH_ATTN is set, but flash-attn is installed ({found}): it is used, not rdna_flash_attn's stand-in")


@pytest.mark.skipif(REAL_FLASH_ATTN is not None, reason=f"a real flash-attn is installed ({REAL_FLASH_ATTN})")
def test_provide_flash_attn_puts_the_stand_in_first_once_and_only_on_request(no_cached_flash_attn, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert autoload.provide_flash_attn({}) is None and autoload.FLASH_ATTN_SHIM_DIR not in sys.path
    for _ in range(2):
        assert autoload.provide_flash_attn({"RDNA_FA_FLASH_ATTN": "yes"}) is None
    assert sys.path[0] == autoload.FLASH_ATTN_SHIM_DIR and sys.path.count(autoload.FLASH_ATTN_SHIM_DIR) == 1
    assert Path(autoload.FLASH_ATTN_SHIM_DIR) == SHIM_DIR
    assert autoload.real_flash_attn() is None  # the stand-in is not a real flash-attn
    assert importlib.import_module("flash_attn").flash_attn_func is fa.flash_attn_func


def test_provide_flash_attn_never_raises(monkeypatch, log_records):
    def broken(name):
        raise ValueError("flash_attn.__spec__ is None")

    monkeypatch.setattr(importlib.util, "find_spec", broken)
    assert autoload.provide_flash_attn({"RDNA_FA_FLASH_ATTN": "1"}) is None
    assert any(r.levelno == logging.WARNING and "RDNA_FA_FLASH_ATTN" in r.getMessage() for r in log_records.records)


@pytest.fixture
def launcher_sandbox(monkeypatch, no_cached_flash_attn):
    """launch.main() rewrites sys.argv, sys.path and the environment, as it should in its own process;
    give them back after an in-process run."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("RDNA_FA_PATCH_SDPA", "RDNA_FA_TRAINING", "RDNA_FA_FLASH_ATTN"):
        monkeypatch.setenv(name, "")  # records the value before, so teardown removes what main() sets
        monkeypatch.delenv(name)
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))  # for the script's child process


FLASH_ATTN_SCRIPT = """
import json, os, subprocess, sys
import flash_attn
child = subprocess.run([sys.executable, "-c", "import flash_attn; print(flash_attn.__version__)"],
                       capture_output=True, text=True)
json.dump(dict(version=flash_attn.__version__, file=flash_attn.__file__, path=sys.path[:2],
               variable=os.environ.get("RDNA_FA_FLASH_ATTN"), pythonpath=os.environ["PYTHONPATH"],
               child=child.stdout.strip() or child.stderr), open(sys.argv[1], "w"))
"""


@pytest.mark.skipif(REAL_FLASH_ATTN is not None, reason=f"a real flash-attn is installed ({REAL_FLASH_ATTN})")
def test_launcher_flash_attn_option_here_and_in_child_processes(tmp_path, launcher_sandbox, capsys):
    script = tmp_path / "train.py"
    script.write_text(FLASH_ATTN_SCRIPT)
    out = tmp_path / "seen.json"
    launch.main(["--flash-attn", str(script), str(out)])
    seen = json.loads(out.read_text())
    assert seen["version"] == "2.8.3" and Path(seen["file"]).is_relative_to(SHIM_DIR)
    assert seen["path"] == [str(tmp_path), str(SHIM_DIR)]  # the script's folder stays sys.path[0]
    assert seen["variable"] == "1" and seen["pythonpath"] == os.pathsep.join([str(SHIM_DIR), str(REPO_ROOT)])
    assert seen["child"] == "2.8.3"  # a DeepSpeed / accelerate worker would find it too
    assert "`import flash_attn` gives rdna_flash_attn's flash-attn 2.8.3 API" in capsys.readouterr().err


def test_launcher_flash_attn_option_leaves_an_installed_flash_attn_alone(tmp_path, launcher_sandbox, capsys):
    script = tmp_path / "train.py"
    script.write_text(FLASH_ATTN_SCRIPT)
    beside = tmp_path / "flash_attn"  # a flash_attn package beside the script counts as installed
    beside.mkdir()
    (beside / "__init__.py").write_text("__version__ = '2.6.3'\n")
    out = tmp_path / "seen.json"
    launch.main(["--flash-attn", str(script), str(out)])
    seen = json.loads(out.read_text())
    assert seen["version"] == "2.6.3" and seen["pythonpath"] == str(REPO_ROOT)
    assert f"`import flash_attn` gives the installed flash-attn ({beside / '__init__.py'})" in capsys.readouterr().err
