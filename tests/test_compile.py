"""torch.compile over the drop-in: the decision is made at trace time on metadata, a supported call
puts the kernels' custom op into the graph with no graph break, any other call puts SDPA there, and
changed settings or device verdicts make dynamo decide again."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import rdna_flash_attn as rfa
from rdna_flash_attn.ops import autograd, plans
from rdna_flash_attn.dispatch import planner, selftest, state
from rdna_flash_attn.config import settings

from .conftest import _math_attention, _real_plan_forward

pytestmark = pytest.mark.skipif(not autograd.HAS_CUSTOM_OP, reason="the kernels' custom op needs torch >= 2.4")

REAL_FLASH_ATTENTION = autograd.flash_attention
REAL_FLASH_ATTENTION_WITH_LSE = autograd.flash_attention_with_lse


_op_runs: list[tuple] = []


def _cpu_forward(q, k, v, attn_mask, is_causal, scale, bottom_right, training):
    _op_runs.append(q.shape)
    out, lse = _math_attention(q, k, v, is_causal, scale, attn_mask, bottom_right)
    return out.contiguous(), lse.contiguous(), *autograd._stats_or_empty(q, training)


@pytest.fixture
def traceable_fake_gpu(fake_gpu, monkeypatch):
    """fake_gpu that dynamo can trace: ops' real plans take CPU tensors for the GPU's, and the real
    custom op gets a CPU kernel (float32 math) for this test only."""
    import torch._dynamo

    monkeypatch.setattr(plans, "KERNEL_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(plans, "plan_forward", _real_plan_forward)
    monkeypatch.setattr(autograd, "flash_attention", REAL_FLASH_ATTENTION)
    monkeypatch.setattr(autograd, "flash_attention_with_lse", REAL_FLASH_ATTENTION_WITH_LSE)
    library = torch.library.Library(autograd.OP_NAMESPACE, "IMPL")
    library.impl("fwd", _cpu_forward, "CPU")
    torch._dynamo.reset()
    _op_runs.clear()
    yield fake_gpu
    torch._dynamo.reset()
    library._destroy()


class Graphs:
    """A torch.compile backend that keeps every graph dynamo hands it and runs it as it is."""

    def __init__(self):
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, graph, example_inputs):
        self.graphs.append(graph)
        return graph.forward

    def targets(self, index: int = -1) -> list:
        return [node.target for node in self.graphs[index].graph.nodes if node.op == "call_function"]


def kernel_op():
    return getattr(torch.ops, autograd.OP_NAMESPACE).fwd


def qkv(dtype=torch.float16, layout="bhsd"):
    gen = torch.Generator().manual_seed(0)
    shape = (2, 3, 40, 64) if layout == "bhsd" else (2, 40, 3, 64)
    tensors = [torch.randn(shape, generator=gen, dtype=dtype) for _ in range(3)]
    return tensors if layout == "bhsd" else [t.transpose(1, 2) for t in tensors]


def attention(q, k, v, **kwargs):
    return rfa.scaled_dot_product_attention(q, k, v, **kwargs) * 2


def compiled(backend: Graphs, **kwargs):
    return torch.compile(lambda q, k, v: attention(q, k, v, **kwargs), backend=backend, fullgraph=True)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("kwargs", [{}, {"is_causal": True, "scale": 0.3}])
def test_supported_call_compiles_to_the_kernels_op_without_graph_breaks(traceable_fake_gpu, layout, kwargs):
    q, k, v = qkv(layout=layout)
    backend = Graphs()
    with torch.no_grad():
        out = compiled(backend, **kwargs)(q, k, v)  # fullgraph=True: a graph break raises
    assert len(backend.graphs) == 1
    assert kernel_op().default in backend.targets() or kernel_op() in backend.targets(), backend.graphs[0].graph
    assert F.scaled_dot_product_attention not in backend.targets()
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs) * 2
    torch.testing.assert_close(out.float(), expected, atol=4e-3, rtol=0)


def test_unsupported_call_compiles_to_sdpa_and_logs_the_reason_once(traceable_fake_gpu, log_records):
    q, k, v = qkv(dtype=torch.float32)
    backend = Graphs()
    function = compiled(backend)
    for _ in range(2):
        out = function(q, k, v)
    assert len(backend.graphs) == 1 and kernel_op().default not in backend.targets()
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v) * 2)
    lines = [r.getMessage() for r in log_records.records if "torch.compile graph" in r.getMessage()]
    assert len(lines) == 1 and "float32" in lines[0]


def test_changed_settings_make_dynamo_decide_again(traceable_fake_gpu):
    q, k, v = qkv()
    backend = Graphs()
    function = compiled(backend)
    runs = []
    for disable in (False, True, False):
        settings.disable = disable
        function(q, k, v)
        runs.append(len(_op_runs))
    assert [kernel_op().default in backend.targets(i) for i in range(len(backend.graphs))] == [True, False]
    assert runs == [1, 1, 2]  # the third call is the first graph's again


def test_a_kernel_turned_off_makes_dynamo_decide_again(traceable_fake_gpu):
    q, k, v = qkv()
    backend = Graphs()
    function = compiled(backend)
    function(q, k, v)
    kernels = planner.call_kernels(q.dtype, q.shape[-1], False, False)
    state.disable_kernels(q.device, kernels, "the kernel failed (test)")
    function(q, k, v)
    assert [kernel_op().default in backend.targets(i) for i in range(len(backend.graphs))] == [True, False]


def test_first_use_self_test_runs_eagerly_once_at_trace_time(untested_fake_gpu, traceable_fake_gpu, monkeypatch):
    seen = []

    def checks(device, gradients=None):
        seen.append(type(torch.ones(2) + 1) is torch.Tensor)  # real tensors: run, not traced
        return []

    monkeypatch.setattr(selftest, "run_checks", checks)
    monkeypatch.setattr(selftest, "cached", lambda library: None)
    state.forget_devices()
    backend = Graphs()
    function = compiled(backend)
    for _ in range(3):
        function(*qkv())
    assert seen == [True] and len(backend.graphs) == 1 and kernel_op().default in backend.targets()


def test_gradients_compile_through_the_kernels_op(traceable_fake_gpu):
    q, k, v = (t.requires_grad_() for t in qkv(dtype=torch.bfloat16))
    backend = Graphs()
    out = compiled(backend)(q, k, v)
    assert kernel_op().default in backend.targets()
    assert out.requires_grad


def test_trace_time_marker_is_the_one_torch_sets():
    def public():
        return None

    def ours():
        return None

    torch.compiler.assume_constant_result(public)
    planner.constant_while_tracing(ours)
    assert vars(ours) == vars(public) and vars(ours)


def test_patched_torch_sdpa_compiles_to_the_kernels_op(traceable_fake_gpu):
    """What ComfyUI's TorchCompileModel and diffusers' torch.compile meet: models calling torch's
    SDPA by name, routed through the dispatcher by the patch."""
    q, k, v = qkv()
    backend = Graphs()
    with rfa.patch_sdpa(), torch.no_grad():
        out = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v) * 2, backend=backend,
                            fullgraph=True)(q, k, v)
    assert len(backend.graphs) == 1 and kernel_op().default in backend.targets()
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float()) * 2
    torch.testing.assert_close(out.float(), expected, atol=4e-3, rtol=0)


def test_dynamic_shapes_keep_one_graph_on_the_kernels(traceable_fake_gpu):
    """Resolutions change the token count: one dynamic graph serves them, on the kernels."""
    backend = Graphs()
    function = torch.compile(attention, backend=backend, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for tokens in (40, 56, 72):
            q, k, v = (torch.randn(2, 3, tokens, 64, dtype=torch.float16) for _ in range(3))
            expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float()) * 2
            torch.testing.assert_close(function(q, k, v).float(), expected, atol=4e-3, rtol=0)
    assert len(backend.graphs) == 1 and kernel_op().default in backend.targets()
    assert len(_op_runs) == 3


def test_a_diffusers_transformer_with_routing_hooks_compiles_to_the_kernels_op(traceable_fake_gpu):
    """install_attention_processor's hooks on Flux's own processors: dynamo splits the graph at each
    hook (a scope is opened and closed there) but both attention calls still compile to the kernels."""
    pytest.importorskip("diffusers")
    from .trainers.test_diffusers_processor import flux_inputs, tiny_flux

    settings.fp32_cast = "fp16"
    flux, inputs = tiny_flux(), flux_inputs()
    with torch.no_grad():
        expected = flux(**inputs).sample
        rfa.install_attention_processor(flux)
        backend = Graphs()
        out = torch.compile(flux, backend=backend)(**inputs).sample
    targets = [target for index in range(len(backend.graphs)) for target in backend.targets(index)]
    assert targets.count(kernel_op().default) == 2 and F.scaled_dot_product_attention not in targets
    assert F.scaled_dot_product_attention is not rfa.scaled_dot_product_attention
    torch.testing.assert_close(out, expected, atol=1e-3, rtol=0)
