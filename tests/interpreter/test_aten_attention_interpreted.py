"""torch's flash attention aten op and its backward (through autograd) served by the shipped code objects
(integrations/aten_attention.py, registered for the CPU's dispatch key), run by the CPU interpreter:
the forward within 2x math SDPA's error against fp64, each gradient within FlashAttention-2's bound."""

from __future__ import annotations

import pytest
import torch

from rdna_fa_lab.attention_reference import (attention_fp64, backward_bound, grads_fp64, grads_input_dtype, max_error,
                                             sdpa_math)
from rdna_flash_attn.integrations import aten_attention

from ..seeds import case_seed

pytest.importorskip("tinygrad", reason="the interpreter decodes with tinygrad==0.14.0 (requirements-dev.txt)")
if not hasattr(torch.library, "get_kernel"):
    pytest.skip("torch.library.get_kernel needs PyTorch 2.9 or newer", allow_module_level=True)

from rdna_fa_lab.stand_in import stand_in_gpu  # noqa: E402


@pytest.mark.parametrize("target, dtype, causal",
                         [("gfx1201", torch.bfloat16, True), ("gfx1100", torch.float16, False)])
def test_the_aten_ops_on_the_code_objects_match_fp64(target, dtype, causal):
    generator = torch.Generator().manual_seed(case_seed((target, dtype, causal)))
    q, k, v, dout = (torch.randn(1, 2, 40, 64, generator=generator).to(dtype) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with stand_in_gpu(target) as gpu:
        assert aten_attention.serve_aten_attention("cpu") is None
        try:
            out = torch.ops.aten._scaled_dot_product_flash_attention(*leaves, is_causal=causal)[0]
            out.backward(dout)
        finally:
            aten_attention.stop_serving_aten_attention("cpu")
    assert len(gpu.launches) == 3  # the forward, dQ and dK/dV
    reference = attention_fp64(q, k, v, causal)[0]
    error, baseline = max_error(out, reference), max_error(sdpa_math(q, k, v, causal), reference)
    assert error <= 2 * baseline, f"forward error {error:.3e} > 2 x SDPA math's {baseline:.3e}"
    exact, input_dtype = grads_fp64(q, k, v, dout, causal), grads_input_dtype(q, k, v, dout, causal)
    for name, leaf, ref, base in zip(("dq", "dk", "dv"), leaves, exact, input_dtype):
        error, bound = max_error(leaf.grad, ref), backward_bound(max_error(base, ref))
        assert error <= bound, f"{name}: error {error:.3e} > FlashAttention-2's bound {bound:.3e}"
