"""Every ComfyUI attention call form through the real `optimized_attention` (wrap_attn) with the
node's override in transformer_options, against the same call without it."""

from __future__ import annotations

import logging

import pytest
import torch

import rdna_flash_attn
from rdna_flash_attn.config import settings

BF16_TOLERANCE = 2e-2  # bf16 output rounding of attention values of magnitude ~1


@pytest.fixture
def attention():
    from comfy.ldm.modules import attention

    return attention


@pytest.fixture
def routed(node_package):
    """transformer_options holding the model node's override (default options)."""
    transformer_options = {}
    node_package.model_patch.install_override(transformer_options, node_package.routing.RoutingOptions())
    return transformer_options


def randn(*shape, dtype=torch.bfloat16, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def flat_qkv(batch=2, heads=8, head_dim=16, tokens=64, context=7, dtype=torch.bfloat16):
    """SD-style (B, L, H*D) self/cross attention inputs (k, v from a 7-token text context)."""
    width = heads * head_dim
    return randn(batch, tokens, width, dtype=dtype), randn(batch, context, width, dtype=dtype, seed=1), \
        randn(batch, context, width, dtype=dtype, seed=2)


def head_qkv(batch=2, heads=4, head_dim=16, tokens=40, dtype=torch.bfloat16):
    """Flux/WAN-style (B, H, L, D) inputs."""
    return tuple(randn(batch, heads, tokens, head_dim, dtype=dtype, seed=s) for s in range(3))


CALL_FORMS = {
    "sd (B, L, H*D)": lambda: (flat_qkv(), dict(heads=8)),
    "sd2 attn_precision=float32": lambda: (flat_qkv(heads=5, head_dim=64), dict(heads=5, attn_precision=torch.float32)),
    "flux skip_reshape": lambda: (head_qkv(), dict(heads=4, skip_reshape=True)),
    "wan skip_reshape + skip_output_reshape": lambda: (head_qkv(), dict(heads=4, skip_reshape=True, skip_output_reshape=True)),
}


@pytest.mark.parametrize("form", CALL_FORMS)
def test_supported_call_forms_run_on_the_kernels(form, attention, routed, fake_gpu):
    (q, k, v), kwargs = CALL_FORMS[form]()
    heads = kwargs.pop("heads")
    expected = attention.optimized_attention(q, k, v, heads, transformer_options={}, **kwargs)
    out = attention.optimized_attention(q, k, v, heads, transformer_options=routed, **kwargs)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=BF16_TOLERANCE, rtol=BF16_TOLERANCE)
    assert len(fake_gpu.launches) == 1
    assert rdna_flash_attn.stats()["kernel"] == 1 and rdna_flash_attn.stats()["fallback"] == 0


MASKS = {  # additive, as ComfyUI's models pass them
    "2-D": lambda: torch.randn(64, 7, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16),
    "3-D": lambda: torch.randn(2, 64, 7, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16),
    "4-D key padding": lambda: torch.zeros(2, 1, 1, 7, dtype=torch.bfloat16).index_fill_(-1, torch.tensor([5, 6]),
                                                                                          float("-inf")),
}


@pytest.mark.parametrize("mask", MASKS)
def test_masked_calls_run_on_the_kernels_as_comfyui_reads_the_mask(mask, attention, routed, fake_gpu):
    q, k, v = flat_qkv(head_dim=64)
    mask = MASKS[mask]()
    expected = attention.optimized_attention_masked(q, k, v, 8, mask, transformer_options={})
    out = attention.optimized_attention_masked(q, k, v, 8, mask, transformer_options=routed)
    torch.testing.assert_close(out.float(), expected.float(), atol=BF16_TOLERANCE, rtol=BF16_TOLERANCE)
    assert len(fake_gpu.launches) == 1 and rdna_flash_attn.stats()["fallback"] == 0


def test_masked_calls_without_masked_kernels_run_the_original_backend_and_say_why_once(attention, routed, fake_gpu,
                                                                                       log_records):
    q, k, v = flat_qkv(head_dim=256)  # no masked kernel
    mask = MASKS["2-D"]()
    expected = attention.optimized_attention_masked(q, k, v, 8, mask, transformer_options={})
    for _ in range(2):
        out = attention.optimized_attention_masked(q, k, v, 8, mask, transformer_options=routed)
        assert torch.equal(out, expected)
    assert fake_gpu.launches == []
    ((reason, count),) = rdna_flash_attn.stats()["fallback_reasons"].items()
    assert count == 2 and reason.startswith("attn_mask with head dim 256")
    assert [r.getMessage() for r in log_records.records].count(
        f"RDNA Flash Attention: not using the kernels: {reason} (ComfyUI's attention runs these calls)") == 1


def test_bool_masks_run_the_original_backend(attention, routed, node_package, fake_gpu):
    q, k, v = flat_qkv(head_dim=64)
    mask = torch.rand(2, 1, 64, 7, generator=torch.Generator().manual_seed(5)) > 0.3
    expected = attention.optimized_attention_masked(q, k, v, 8, mask, transformer_options={})
    assert torch.equal(attention.optimized_attention_masked(q, k, v, 8, mask, transformer_options=routed), expected)
    assert fake_gpu.launches == [] and "bool mask" in next(iter(node_package.routing.comfy_fallbacks))


def test_unsupported_head_dim_runs_the_original_backend(attention, routed, fake_gpu, log_records):
    q, k, v = flat_qkv(heads=4, head_dim=12)  # head dims are multiples of 8
    expected = attention.optimized_attention(q, k, v, 4, transformer_options={})
    for _ in range(2):
        assert torch.equal(attention.optimized_attention(q, k, v, 4, transformer_options=routed), expected)
    assert fake_gpu.launches == []
    ((reason, count),) = rdna_flash_attn.stats()["fallback_reasons"].items()
    assert count == 2 and "12" in reason
    assert sum(reason in r.getMessage() for r in log_records.records) == 1


def test_cpu_model_runs_the_original_backend(attention, routed, log_records):
    q, k, v = flat_qkv()
    expected = attention.optimized_attention(q, k, v, 8, transformer_options={})
    for _ in range(2):
        assert torch.equal(attention.optimized_attention(q, k, v, 8, transformer_options=routed), expected)
    reasons = rdna_flash_attn.stats()["fallback_reasons"]
    assert list(reasons) == ["CPU tensors (the kernels run on AMD RDNA3/RDNA4 GPUs)"] and rdna_flash_attn.stats()["kernel"] == 0
    assert sum("CPU tensors" in r.getMessage() for r in log_records.records) == 1


def spy_backend(seen: list):
    """A stand-in for a ComfyUI backend that records what it is called with and returns zeros."""

    def backend(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False, **kwargs):
        seen.append(dict(kwargs, mask=mask, skip_reshape=skip_reshape))
        return torch.zeros(1)

    return backend


UNKNOWN_KEYWORD_REASON = "ComfyUI attention keyword 'causal' is not known to this node"


def test_an_unknown_keyword_with_a_value_runs_the_original_backend(node_package, fake_gpu, log_records):
    override = node_package.model_patch.make_override(node_package.routing.RoutingOptions())
    seen = []
    q, k, v = flat_qkv()
    for _ in range(2):  # a future keyword that may change the result (here: causal)
        override(spy_backend(seen), q, k, v, 8, causal=True, transformer_options={})
    assert seen == [dict(causal=True, transformer_options={}, mask=None, skip_reshape=False)] * 2
    assert fake_gpu.launches == []
    assert node_package.routing.comfy_fallbacks == {UNKNOWN_KEYWORD_REASON: 2}
    assert sum(UNKNOWN_KEYWORD_REASON in r.getMessage() for r in log_records.records) == 1


def test_an_unknown_keyword_set_to_none_or_false_leaves_the_call_on_the_kernels(node_package, fake_gpu):
    override = node_package.model_patch.make_override(node_package.routing.RoutingOptions())
    seen = []
    q, k, v = flat_qkv()
    out = override(spy_backend(seen), q, k, v, 8, causal=False, varlen_lengths=None, transformer_options={})
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(t.float().unflatten(-1, (8, -1)).transpose(1, 2) for t in (q, k, v))).transpose(1, 2).flatten(2)
    torch.testing.assert_close(out.float(), expected, atol=BF16_TOLERANCE, rtol=BF16_TOLERANCE)
    assert seen == [] and len(fake_gpu.launches) == 1 and node_package.routing.comfy_fallbacks == {}


def test_a_reason_met_before_logging_was_on_is_logged_once_it_is(node_package, fake_gpu, caplog):
    override = node_package.model_patch.make_override(node_package.routing.RoutingOptions())
    q, k, v = flat_qkv()
    caplog.set_level(logging.WARNING, logger="rdna_flash_attn")
    override(spy_backend([]), q, k, v, 8, causal=True)
    assert not any(UNKNOWN_KEYWORD_REASON in r.getMessage() for r in caplog.records)
    caplog.set_level(logging.INFO, logger="rdna_flash_attn")
    for _ in range(2):
        override(spy_backend([]), q, k, v, 8, causal=True)
    assert sum(UNKNOWN_KEYWORD_REASON in r.getMessage() for r in caplog.records) == 1


def _raise(*args, **kwargs):
    raise RuntimeError("a fault in the routing code")


ROUTING_FAULTS = {  # (function of nodes/routing.py made to raise, masked call)
    "reshape": ("_heads_view", False),
    "comfy import / training check": ("_in_training", False),
    "call binding": ("bind_call", False),
    "fallback choice": ("_pytorch_backend", True),
}


@pytest.mark.parametrize("fault", ROUTING_FAULTS)
def test_an_error_in_the_routing_code_runs_the_original_backend(fault, node_package, attention, fake_gpu,
                                                                log_records, monkeypatch):
    target, masked = ROUTING_FAULTS[fault]
    routing = node_package.routing
    monkeypatch.setattr(routing, target, _raise)
    transformer_options = {}
    node_package.model_patch.install_override(transformer_options, routing.RoutingOptions(fallback=routing.FALLBACK_PYTORCH))
    q, k, v = flat_qkv(head_dim=256 if masked else 16)  # no masked kernel at 256: the fallback is chosen
    mask = torch.zeros(2, 64, 7, dtype=torch.bfloat16) if masked else None
    expected = attention.optimized_attention_masked(q, k, v, 8, mask, transformer_options={})
    for _ in range(2):
        out = attention.optimized_attention_masked(q, k, v, 8, mask, transformer_options=transformer_options)
        assert torch.equal(out, expected)
    assert fake_gpu.launches == []
    reason = "error in the node's routing code (RuntimeError)"
    assert routing.comfy_fallbacks[reason] == 2
    warnings = [r for r in log_records.records if reason in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING and warnings[0].exc_info is not None


def test_scale_is_honoured(node_package, fake_gpu):
    override = node_package.model_patch.make_override(node_package.routing.RoutingOptions())
    q, k, v = head_qkv()
    out = override(spy_backend([]), q, k, v, 4, skip_reshape=True, skip_output_reshape=True, scale=0.3)
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=0.3)
    torch.testing.assert_close(out.float(), expected, atol=BF16_TOLERANCE, rtol=BF16_TOLERANCE)
    assert fake_gpu.launches[0][4] == 0.3


def test_grouped_query_attention_runs_on_the_kernels_without_repeating_heads(node_package, fake_gpu):
    override = node_package.model_patch.make_override(node_package.routing.RoutingOptions())
    seen = []
    q = randn(1, 8, 16, 16)
    k, v = randn(1, 2, 16, 16, seed=1), randn(1, 2, 16, 16, seed=2)
    out = override(spy_backend(seen), q, k, v, 8, skip_reshape=True, enable_gqa=True)
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    torch.testing.assert_close(out.float().unflatten(-1, (8, 16)).transpose(1, 2), expected,
                               atol=BF16_TOLERANCE, rtol=BF16_TOLERANCE)
    assert seen == [] and fake_gpu.launches[0][1].shape[1] == 2


def test_low_precision_attention_false_keeps_float32_off_16_bit_kernels(node_package, fake_gpu):
    settings.fp32_cast = "bf16"
    override = node_package.model_patch.make_override(node_package.routing.RoutingOptions())
    seen = []
    q, k, v = head_qkv(dtype=torch.float32)
    override(spy_backend(seen), q, k, v, 4, skip_reshape=True, low_precision_attention=False)
    assert len(seen) == 1 and fake_gpu.launches == []
    assert node_package.routing.comfy_fallbacks == {"low_precision_attention=False with float32 inputs": 1}
    override(spy_backend(seen), q, k, v, 4, skip_reshape=True)  # without it, the fp32 policy applies
    q, k, v = head_qkv()
    override(spy_backend(seen), q, k, v, 4, skip_reshape=True, low_precision_attention=False)
    assert len(seen) == 1 and len(fake_gpu.launches) == 2



def test_low_precision_attention_false_runs_an_8bit_nodes_calls_exact(node_package, attention, fake_gpu):
    """ComfyUI passes low_precision_attention=False as a keyword of optimized_attention where Sage-style
    attention breaks the model (Wan's image cross-attention, Stable Audio, Hunyuan3D 2.1): a node set to
    8-bit runs those calls on the exact kernels; its other calls reach the dispatcher as 8-bit (which on
    this RDNA3 stand-in runs them exact, for its own reason)."""
    routing = node_package.routing
    transformer_options = {}
    node_package.model_patch.install_override(transformer_options, routing.RoutingOptions(precision="8bit-qkpv"))
    q, k, v = head_qkv()
    out = attention.optimized_attention(q, k, v, 4, skip_reshape=True, skip_output_reshape=True,
                                        transformer_options=transformer_options, low_precision_attention=False)
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    torch.testing.assert_close(out.float(), expected, atol=BF16_TOLERANCE, rtol=BF16_TOLERANCE)
    assert rdna_flash_attn.stats()["kernel"] == 1 and rdna_flash_attn.stats()["exact_not_8bit_reasons"] == {}
    assert routing.comfy_exact_not_8bit == {routing.NO_LOW_PRECISION: 1}
    attention.optimized_attention(q, k, v, 4, skip_reshape=True, transformer_options=transformer_options)
    rdna3_reason = "8-bit attention needs RDNA4 (gfx12); gfx1100 has no faster 8-bit matrix rate"
    assert rdna_flash_attn.stats()["exact_not_8bit_reasons"] == {rdna3_reason: 1}
    assert routing.comfy_exact_not_8bit == {routing.NO_LOW_PRECISION: 1} and len(fake_gpu.launches) == 2

def test_pytorch_fallback_option_uses_comfyuis_pytorch_backend(node_package, attention, fake_gpu, monkeypatch):
    pytorch_calls = []
    original = attention.REGISTERED_ATTENTION_FUNCTIONS["pytorch"]

    def pytorch_spy(*args, **kwargs):
        pytorch_calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setitem(attention.REGISTERED_ATTENTION_FUNCTIONS, "pytorch", pytorch_spy)
    routing = node_package.routing
    transformer_options = {}
    node_package.model_patch.install_override(transformer_options, routing.RoutingOptions(fallback=routing.FALLBACK_PYTORCH))
    q, k, v = flat_qkv(head_dim=256)  # a masked call the kernels refuse (no masked kernel at 256)
    mask = torch.zeros(2, 64, 7, dtype=torch.bfloat16)
    out = attention.optimized_attention_masked(q, k, v, 8, mask, transformer_options=transformer_options)
    expected = attention.attention_pytorch(q, k, v, 8, mask, transformer_options={})
    assert len(pytorch_calls) == 1 and torch.equal(out, expected)


def test_a_prior_override_stays_in_charge(node_package, attention, fake_gpu):
    prior_calls = []

    def prior(func, *args, **kwargs):
        prior_calls.append(args[0].shape)
        return func(*args, **kwargs) * 2  # e.g. a node that rescales attention output

    transformer_options = {"optimized_attention_override": prior}
    routing = node_package.routing
    node_package.model_patch.install_override(transformer_options, routing.RoutingOptions())
    node_package.model_patch.install_override(transformer_options, routing.RoutingOptions())  # a second node: replaces, not stacks
    q, k, v = flat_qkv()
    expected = attention.optimized_attention(q, k, v, 8, transformer_options={}) * 2
    out = attention.optimized_attention(q, k, v, 8, transformer_options=transformer_options)
    torch.testing.assert_close(out.float(), expected.float(), atol=2 * BF16_TOLERANCE, rtol=BF16_TOLERANCE)
    assert len(prior_calls) == 1 and len(fake_gpu.launches) == 1
    node_package.model_patch.remove_override(transformer_options)
    assert transformer_options == {"optimized_attention_override": prior}


@pytest.mark.parametrize("use_for_training", [True, False])
def test_gradients_follow_the_training_toggle(use_for_training, node_package, attention, fake_gpu):
    transformer_options = {}
    options = node_package.routing.RoutingOptions(training=use_for_training)
    node_package.model_patch.install_override(transformer_options, options)
    q, k, v = (t.requires_grad_() for t in flat_qkv())
    attention.optimized_attention(q, k, v, 8, transformer_options=transformer_options).float().square().sum().backward()
    assert fake_gpu.differentiable_launches == (1 if use_for_training else 0)
    assert q.grad is not None and k.grad is not None
    if not use_for_training:
        assert list(node_package.routing.comfy_fallbacks) == [
            "training (gradients or ComfyUI's in_training) and the node's use_for_training is off"]


def test_comfyui_in_training_flag_counts_as_training(node_package, attention, fake_gpu, monkeypatch):
    import comfy.model_management

    monkeypatch.setattr(comfy.model_management, "in_training", True, raising=False)
    transformer_options = {}
    node_package.model_patch.install_override(transformer_options, node_package.routing.RoutingOptions(training=False))
    q, k, v = flat_qkv()
    attention.optimized_attention(q, k, v, 8, transformer_options=transformer_options)
    assert fake_gpu.launches == []
    monkeypatch.setattr(comfy.model_management, "in_training", False)
    attention.optimized_attention(q, k, v, 8, transformer_options=transformer_options)
    assert len(fake_gpu.launches) == 1



def test_a_node_replaces_the_global_switchs_override(node_package, attention, fake_gpu):
    model_patch = node_package.model_patch
    transformer_options = {model_patch.OVERRIDE_KEY: node_package.global_switch.global_override}
    node_package.enable_global()
    model_patch.install_override(transformer_options, node_package.routing.RoutingOptions())
    assert getattr(transformer_options[model_patch.OVERRIDE_KEY], model_patch.PREVIOUS_ATTR) is None
    q, k, v = flat_qkv()
    attention.optimized_attention(q, k, v, 8, transformer_options=transformer_options)
    assert len(fake_gpu.launches) == 1 and rdna_flash_attn.stats()["kernel"] == 1


@pytest.fixture
def routers_in_place(model_node):
    """The direct-call routers, which the model node puts in place when it routes a model."""
    from rdna_fa_lab.hosts.comfyui_harness import build

    model_node.patch(build("sd15"), True, True, "original backend")


def test_calls_looked_up_in_the_attention_module_at_call_time(node_package, attention, routers_in_place, fake_gpu):
    """SeedVR2's DiT (and MiniMax Music's, through optimized_attention_for_device) look ComfyUI's attention
    function up in its module at each call, without the model's options: routed while a routed model runs."""
    q, k, v = head_qkv()
    expected = attention.optimized_attention(q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
    assert fake_gpu.launches == []
    with node_package.direct_calls.running(node_package.routing.RoutingOptions()):
        out = attention.optimized_attention(q, k, v, 4, skip_reshape=True, skip_output_reshape=True)
        found = attention.optimized_attention_for_device(torch.device("cuda"))(q, k, v, 4, skip_reshape=True,
                                                                               skip_output_reshape=True)
    assert len(fake_gpu.launches) == 2
    for result in (out, found):
        torch.testing.assert_close(result.float(), expected.float(), atol=BF16_TOLERANCE, rtol=BF16_TOLERANCE)



def test_calls_passing_options_without_an_override_are_routed_while_a_routed_model_runs(node_package, attention, routed,
                                                                                       routers_in_place, fake_gpu):
    """WanDancer's audio injector (and LTX-2's text connectors) call a block whose transformer_options default to an
    empty dict: ComfyUI's attention gets options holding no override. Calls whose options hold the node's override
    run on the kernels once, through it."""
    q, k, v = head_qkv()
    expected = attention.optimized_attention(q, k, v, 4, skip_reshape=True, skip_output_reshape=True,
                                             transformer_options={})
    assert fake_gpu.launches == []
    with node_package.direct_calls.running(node_package.routing.RoutingOptions()):
        out = attention.optimized_attention(q, k, v, 4, skip_reshape=True, skip_output_reshape=True,
                                            transformer_options={})
        assert len(fake_gpu.launches) == 1
        attention.optimized_attention(q, k, v, 4, skip_reshape=True, skip_output_reshape=True,
                                      transformer_options=routed)
    assert len(fake_gpu.launches) == 2 and rdna_flash_attn.stats()["fallback"] == 0
    torch.testing.assert_close(out.float(), expected.float(), atol=BF16_TOLERANCE, rtol=BF16_TOLERANCE)


def test_calls_in_comfyuis_tensor_containers_are_routed_while_a_routed_model_runs(node_package, attention,
                                                                                  routers_in_place, fake_gpu):
    """MiniMax H3's token refiner hands ComfyUI's attention its q, k, v in single-use containers, with its blocks'
    empty options."""
    if not hasattr(attention, "AttentionTensorContainer"):
        pytest.skip("this ComfyUI has no attention tensor containers")
    q, k, v = head_qkv()
    expected = attention.optimized_attention(q, k, v, 4, skip_reshape=True, transformer_options={})
    containers = [attention.AttentionTensorContainer(t) for t in (q, k, v)]
    with node_package.direct_calls.running(node_package.routing.RoutingOptions()):
        out = attention.optimized_attention(*containers, 4, skip_reshape=True, transformer_options={})
    assert len(fake_gpu.launches) == 1 and rdna_flash_attn.stats()["fallback"] == 0
    assert all(container.tensor is None for container in containers)
    torch.testing.assert_close(out.float(), expected.float(), atol=BF16_TOLERANCE, rtol=BF16_TOLERANCE)

def test_causal_sdpa_calls_of_a_routed_model_reach_the_kernels(node_package, routers_in_place, fake_gpu):
    """HiDream-O1's autoregressive pass calls comfy.ops.scaled_dot_product_attention with is_causal=True."""
    import comfy.ops

    q, k, v = head_qkv(tokens=24)
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    comfy.ops.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
    assert fake_gpu.launches == [], "outside a routed model's call"
    with node_package.direct_calls.running(node_package.routing.RoutingOptions()):
        out = comfy.ops.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        comfy.ops.scaled_dot_product_attention(q, k, v, None, 0.0, False)  # not causal: ComfyUI's own
    torch.testing.assert_close(out.float(), expected, atol=BF16_TOLERANCE, rtol=BF16_TOLERANCE)
    assert len(fake_gpu.launches) == 1 and fake_gpu.launches[0][3] is True
