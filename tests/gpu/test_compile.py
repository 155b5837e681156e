"""torch.compile over a model that calls the drop-in, through the real kernels (on NVIDIA the
emulation of each AMD layer, with RDNA_FA_FORCE=1): one graph, the kernels' op in it, results within
FlashAttention's tolerance of fp64 attention, gradients too; an unsupported call compiles to SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import rdna_flash_attn as rfa
from rdna_flash_attn.ops import autograd, attention as ops

from .conftest import GPU
from rdna_fa_lab.attention_reference import attention_fp64, max_error, sdpa_math

pytestmark = pytest.mark.skipif(not autograd.HAS_CUSTOM_OP, reason="the kernels' custom op needs torch >= 2.4")


@pytest.fixture
def kernel_runs(kernels_on, monkeypatch):
    """Kernels on for this GPU, a fresh dynamo, every real forward launch counted."""
    import torch._dynamo

    torch._dynamo.reset()
    runs = []
    real = ops.flash_attention_forward

    def counting(*args, **kwargs):
        runs.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(ops, "flash_attention_forward", counting)
    yield runs
    torch._dynamo.reset()


class SelfAttention(torch.nn.Module):
    """A diffusers-style block: fused QKV projection, (B, S, H, D) views, the drop-in, out projection."""

    def __init__(self, attention, width=128, heads=2, project_out=True):
        super().__init__()
        self.attention, self.heads = attention, heads
        self.qkv = torch.nn.Linear(width, 3 * width, device=GPU, dtype=torch.float16)
        self.out = torch.nn.Linear(width, width, device=GPU, dtype=torch.float16) if project_out else None

    def qkv_views(self, x):
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, width // self.heads).unbind(2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x, **kwargs):
        o = self.attention(*self.qkv_views(x), **kwargs).transpose(1, 2).reshape(x.shape)
        return o if self.out is None else self.out(o)


class Graphs:
    """Counts the graphs dynamo makes and checks for the kernels' op, then compiles with inductor."""

    def __init__(self):
        self.ops: list[bool] = []

    def __call__(self, graph, example_inputs):
        op = getattr(torch.ops, autograd.OP_NAMESPACE).fwd
        self.ops.append(any(node.target in (op, op.default) for node in graph.graph.nodes))
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(graph, example_inputs)


@pytest.mark.parametrize("causal", [False, True])
def test_compiled_model_runs_on_the_kernels_in_one_graph(kernel_runs, causal):
    torch.manual_seed(0)
    model = SelfAttention(rfa.scaled_dot_product_attention, project_out=False)
    x = torch.randn(2, 300, 128, device=GPU, dtype=torch.float16)
    graphs = Graphs()
    compiled = torch.compile(model, backend=graphs, fullgraph=True)
    with torch.no_grad():
        out = compiled(x, is_causal=causal)
        again = compiled(x, is_causal=causal)
        q, k, v = model.qkv_views(x)
    assert graphs.ops == [True] and len(kernel_runs) == 2
    torch.testing.assert_close(out, again, rtol=0, atol=0)
    reference = attention_fp64(q, k, v, causal)[0].transpose(1, 2).reshape(x.shape)
    yardstick = max_error(sdpa_math(q, k, v, causal).transpose(1, 2).reshape(x.shape), reference)
    assert out.dtype == torch.float16 and max_error(out, reference) <= 2 * yardstick + 1e-5


def test_compiled_training_step_matches_sdpa(kernel_runs):
    torch.manual_seed(0)
    ours = SelfAttention(rfa.scaled_dot_product_attention)
    theirs = SelfAttention(F.scaled_dot_product_attention)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 200, 128, device=GPU, dtype=torch.float16)
    graphs = Graphs()
    out = torch.compile(ours, backend=graphs, fullgraph=True)(x)
    # A sum, not a mean: the gradients stay far from float16's subnormal range.
    out.float().square().sum().backward()
    expected = theirs(x)
    expected.float().square().sum().backward()
    assert graphs.ops == [True]
    out_error, out_scale = max_error(out, expected), expected.abs().max().item()
    assert out_error <= 0.01 * out_scale, (out_error, out_scale)
    for name in ("qkv", "out"):
        grad, expected_grad = getattr(ours, name).weight.grad, getattr(theirs, name).weight.grad
        error, scale = max_error(grad, expected_grad), expected_grad.abs().max().item()
        assert error <= 0.02 * scale, (name, error, scale)


@pytest.mark.parametrize("width, on_kernels", [(128, True), (512, False)])  # head dim 64: masked kernels; 256: none
def test_masked_call_compiles_to_the_kernels_op_where_one_exists(kernel_runs, width, on_kernels):
    torch.manual_seed(0)
    model = SelfAttention(rfa.scaled_dot_product_attention, width=width)
    x = torch.randn(1, 64, width, device=GPU, dtype=torch.float16)
    mask = torch.rand(64, 64, device=GPU) > 0.5
    graphs = Graphs()
    with torch.no_grad():
        out = torch.compile(model, backend=graphs, fullgraph=True)(x, attn_mask=mask)
        model.attention = F.scaled_dot_product_attention
        expected = model(x, attn_mask=mask)
    assert graphs.ops == [on_kernels] and bool(kernel_runs) is on_kernels
    torch.testing.assert_close(out, expected, atol=5e-3, rtol=5e-3)
