"""torch's flash attention aten ops served by the kernels (integrations/aten_attention.py), on the CPU:
fake_gpu's kernels (float32 math behind the real plans) take the calls the dispatcher takes, and every
other call reaches the kernel registered before ours with its arguments unchanged."""

from __future__ import annotations

import pytest
import torch

import rdna_flash_attn as rfa
from rdna_fa_lab.attention_reference import (attention_fp64, backward_bound, grads_fp64, grads_input_dtype,
                                             max_error, sdpa_math)
from rdna_flash_attn.config import settings
from rdna_flash_attn.dispatch import router
from rdna_flash_attn.integrations import aten_attention, autoload

from .seeds import case_seed

FLASH = torch.ops.aten._scaled_dot_product_flash_attention

pytestmark = pytest.mark.skipif(not hasattr(torch.library, "get_kernel"),
                                reason="torch.library.get_kernel needs PyTorch 2.9 or newer")


@pytest.fixture
def served():
    """Our kernels registered for the CPU's dispatch key, removed afterwards."""
    assert aten_attention.serve_aten_attention("cpu") is None
    yield
    aten_attention.stop_serving_aten_attention("cpu")


def inputs(case, dtype=torch.float16, seq_q=24, seq_k=24):
    generator = torch.Generator().manual_seed(case_seed(case))
    q = torch.randn(2, 3, seq_q, 64, generator=generator).to(dtype)
    k, v = (torch.randn(2, 3, seq_k, 64, generator=generator).to(dtype) for _ in range(2))
    return q, k, v, torch.randn(q.shape, generator=generator).to(dtype)


@pytest.mark.parametrize("causal", [False, True])
def test_the_ops_run_on_the_kernels_forward_and_backward(fake_gpu, served, causal):
    q, k, v, dout = inputs(("aten", causal))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, debug = FLASH(*leaves, is_causal=causal, scale=0.2)
    out.backward(dout)
    assert len(fake_gpu.launches) == 1 and fake_gpu.backward_from_output_launches == 1
    assert rfa.stats()["kernel"] == 2 and rfa.stats()["fallback"] == 0
    expected, expected_lse = attention_fp64(q, k, v, causal, 0.2)
    assert max_error(out, expected) <= 2 * max_error(sdpa_math(q, k, v, causal, 0.2), expected)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-4, rtol=0)
    assert lse.dtype == torch.float32 and cum_q is None and cum_k is None and (max_q, max_k) == (24, 24)
    assert debug.numel() == 0
    exact, input_dtype = grads_fp64(q, k, v, dout, causal, 0.2), grads_input_dtype(q, k, v, dout, causal, 0.2)
    for name, leaf, expected_grad, baseline in zip(("dq", "dk", "dv"), leaves, exact, input_dtype):
        error, bound = max_error(leaf.grad, expected_grad), backward_bound(max_error(baseline, expected_grad))
        assert error <= bound, f"{name}: error {error:.3e} > FlashAttention-2's bound {bound:.3e}"


@pytest.mark.parametrize("arguments, reason", [
    (dict(dtype=torch.float32), "float32 inputs"),
    (dict(seq_q=20, causal=True), "causal with different query and key lengths"),
    (dict(dropout_p=0.1), "dropout_p is not 0"),
    (dict(return_debug_mask=True), "return_debug_mask"),
])
def test_calls_the_kernels_do_not_take_reach_the_previous_kernel(fake_gpu, served, arguments, reason):
    # PyTorch's CPU builds have no kernel for the op: the call raises as it did without us
    q, k, v, _ = inputs(("refused", reason), arguments.get("dtype", torch.float16), arguments.get("seq_q", 24))
    with pytest.raises(NotImplementedError, match="no CPU kernel"):
        FLASH(q, k, v, arguments.get("dropout_p", 0.0), arguments.get("causal", False),
              arguments.get("return_debug_mask", False))
    assert not fake_gpu.launches
    assert any(reason in text for text in rfa.stats()["fallback_reasons"]), rfa.stats()


def test_a_registered_kernel_gets_the_calls_on_other_devices(monkeypatch):
    # the Meta key has PyTorch's own kernel: a meta tensor's call reaches it (no device runs our kernels)
    monkeypatch.setattr(router, "device_refusal", lambda device: None)
    assert aten_attention.serve_aten_attention("meta") is None
    try:
        q = torch.empty(1, 2, 8, 16, dtype=torch.float16, device="meta")
        out, lse, *_ = FLASH(q, q, q)
    finally:
        aten_attention.stop_serving_aten_attention("meta")
    assert out.device.type == "meta" and out.shape == q.shape and lse.shape == (1, 2, 8)
    assert rfa.stats()["kernel"] == 0 and rfa.stats()["fallback"] == 1


def test_cuda_is_served_only_in_rocm_builds(monkeypatch, log_records):
    monkeypatch.setattr(torch.version, "hip", None)
    assert aten_attention.serve_aten_attention() == "not a ROCm build of PyTorch"
    assert "not serving torch's flash attention ops" in log_records.text


def test_the_setting_and_the_hook_ask_for_it(monkeypatch):
    served_for = []
    monkeypatch.setattr(aten_attention, "serve_aten_attention", lambda: served_for.append("cuda"))
    assert aten_attention.serve_if_requested() is None and not served_for
    settings.aten_ops = True
    aten_attention.serve_if_requested()
    assert served_for == ["cuda"]
    assert autoload.aten_ops_requested({"RDNA_FA_ATEN_OPS": "1"})
    assert not autoload.aten_ops_requested({})
