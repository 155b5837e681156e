"""kohya sd-scripts' --sdpa call pattern (tests/trainers/scripts/kohya_like.py) under the SDPA override:
calls run on the kernels, forward and backward, with or without a mask (head dim 16 has masked kernels);
results and gradients match the unpatched block."""

from __future__ import annotations

import copy

import pytest
import torch

import rdna_flash_attn

from .scripts.kohya_like import KohyaStyleBlock



def run_block(block, x, context, mask):
    x = x.clone().requires_grad_(True)
    out = block(x, context, mask)
    out.float().square().mean().backward()
    return out.detach().float(), x.grad.float(), [p.grad.float() for p in block.parameters()]


def relative_error(actual, expected):
    return ((actual - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("masked", [False, True], ids=["no mask", "mask"])
def test_kohya_style_block_routes_through_the_dispatcher(fake_gpu, masked):
    torch.manual_seed(1)
    block = KohyaStyleBlock().to(torch.bfloat16)
    reference_block = copy.deepcopy(block)
    x, context = torch.randn(2, 24, 32, dtype=torch.bfloat16), torch.randn(2, 7, 24, dtype=torch.bfloat16)
    mask = torch.rand(2, 1, 24, 7) > 0.3 if masked else None

    expected = run_block(reference_block, x, context, mask)
    assert rdna_flash_attn.stats()["kernel"] + rdna_flash_attn.stats()["fallback"] == 0  # not patched yet
    with rdna_flash_attn.patch_sdpa():
        actual = run_block(block, x, context, mask)

    assert fake_gpu.differentiable_launches == 2 and rdna_flash_attn.stats()["fallback_reasons"] == {}
    # bf16 inputs: SDPA rounds its intermediate products to bf16, the kernels accumulate in float32
    for got, want in zip([actual[0], actual[1], *actual[2]], [expected[0], expected[1], *expected[2]]):
        assert relative_error(got, want) < 1e-2
