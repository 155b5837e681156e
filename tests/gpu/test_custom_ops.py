"""The custom ops as torch.library and torch.compile see them."""

import pytest
import torch

from rdna_flash_attn.ops import autograd

pytestmark = pytest.mark.skipif(not autograd.HAS_CUSTOM_OP, reason="torch.library.custom_op needs torch >= 2.4")


def _inputs(layout="bhsd", requires_grad=False):
    generator = torch.Generator(device="cuda").manual_seed(7)
    shape = (2, 3, 70, 64) if layout == "bhsd" else (2, 70, 3, 64)
    tensors = [torch.randn(shape, dtype=torch.float16, device="cuda", generator=generator) for _ in range(3)]
    if layout == "bshd":
        tensors = [t.transpose(1, 2) for t in tensors]
    return [t.requires_grad_(requires_grad) for t in tensors]


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("training", [False, True])
def test_opcheck_forward(emulated_layer, layout, causal, training):
    q, k, v = _inputs(layout, requires_grad=True)
    torch.library.opcheck(torch.ops.rdna_flash_attn.fwd.default, (q, k, v, None, causal, None, False, training))


@pytest.mark.parametrize("mask_shape", [(2, 1, 1, 70), (2, 3, 70, 70)])
def test_opcheck_forward_masked(emulated_layer, mask_shape):
    q, k, v = _inputs("bshd", requires_grad=True)
    mask = torch.rand(mask_shape, device="cuda") < 0.8
    torch.library.opcheck(torch.ops.rdna_flash_attn.fwd.default, (q, k, v, mask, False, None, False, True))


@pytest.mark.parametrize("training", [False, True])
def test_opcheck_backward(emulated_layer, training):
    q, k, v = _inputs("bshd")
    out, lse, *stats = torch.ops.rdna_flash_attn.fwd(q, k, v, None, False, 0.2, False, training)
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.rdna_flash_attn.bwd.default,
                          (dout, q, k, v, out, lse, *stats, None, False, 0.2, False))


class TinyAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 3 * 64, dtype=torch.float16, device="cuda")

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = self.proj(x).view(batch, seq, 3, 1, 64).unbind(2)
        out = autograd.flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), True)
        return out.transpose(1, 2).reshape(batch, seq, 64)


def test_compiles_fullgraph_forward_and_backward(emulated_layer):
    torch.manual_seed(0)
    model = TinyAttention()
    x = torch.randn(2, 50, 64, dtype=torch.float16, device="cuda")
    eager = model(x)
    eager.float().square().sum().backward()
    eager_grad = model.proj.weight.grad.clone()
    model.proj.weight.grad = None
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    out.float().square().sum().backward()
    torch.testing.assert_close(out, eager, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(model.proj.weight.grad, eager_grad, atol=5e-2, rtol=2e-2)
