"""The A1111 forwards on real ldm (stable-diffusion-sdkit): outputs equal the originals' on the
kernel path (fake_gpu) and on the fallback path, hypernetworks and upcast_attn as A1111's own
optimizations apply them, per-call fallbacks, training, and undo restoring the exact functions."""

from __future__ import annotations

import copy

import pytest
import torch

import rdna_flash_attn

ldm_attention = pytest.importorskip("ldm.modules.attention", reason="stable-diffusion-sdkit (ldm) not installed")
ldm_model = pytest.importorskip("ldm.modules.diffusionmodules.model")

from extension import a1111, options

# fp16 kernel path vs the original forward in float32 on the same (fp16-valued) weights and inputs:
# the difference is fp16 rounding of the projections and the output (outputs are ~0.2 in size).
KERNEL_TOL = dict(atol=2e-3, rtol=1e-2)
EXACT_TOL = dict(atol=1e-5, rtol=1e-5)  # both in float32 through SDPA / einsum


@pytest.fixture
def patch(webui):
    webui("a1111")
    patch = a1111.ForwardPatch(a1111.a1111_hooks())
    yield patch
    patch.undo()


def cross_attention(context_dim=96, heads=8, dim_head=40, seed=0):
    torch.manual_seed(seed)
    return ldm_attention.CrossAttention(320, context_dim=context_dim, heads=heads, dim_head=dim_head).half().eval()


def attn_block(channels=64, seed=0):
    torch.manual_seed(seed)
    block = ldm_model.AttnBlock(channels).half().eval()
    with torch.no_grad():  # GroupNorm starts as identity: give it something to do
        block.norm.weight.uniform_(0.5, 1.5)
        block.norm.bias.uniform_(-0.5, 0.5)
    return block


def original(module, *inputs, **kwargs):
    """The module's own ldm forward, in float32, on a float32 copy of the same weights."""
    reference = copy.deepcopy(module).float()
    owner = ldm_attention.CrossAttention if isinstance(module, ldm_attention.CrossAttention) else ldm_model.AttnBlock
    forward = a1111_originals[owner]
    return forward(reference, *(t.float() for t in inputs), **kwargs)


a1111_originals = {
    ldm_attention.CrossAttention: ldm_attention.CrossAttention.forward,
    ldm_model.AttnBlock: ldm_model.AttnBlock.forward,
}


def test_kernel_path_cross_and_self_attention_match_the_original(patch, fake_gpu):
    module, self_module = cross_attention(), cross_attention(context_dim=None, seed=1)
    x, context = torch.randn(2, 64, 320).half(), torch.randn(2, 77, 96).half()
    patch.apply()
    with torch.no_grad():
        cross, self_attention = module(x, context), self_module(x)
    assert len(fake_gpu.launches) == 2
    assert [tuple(launch[0].shape) for launch in fake_gpu.launches] == [(2, 8, 64, 40), (2, 8, 64, 40)]
    torch.testing.assert_close(cross.float(), original(module, x, context), **KERNEL_TOL)
    torch.testing.assert_close(self_attention.float(), original(self_module, x), **KERNEL_TOL)


def test_kernel_path_attn_block_matches_the_original(patch, fake_gpu):
    block = attn_block()
    x = torch.randn(2, 64, 6, 5).half()
    patch.apply()
    with torch.no_grad():
        out = block(x)
    assert len(fake_gpu.launches) == 1 and tuple(fake_gpu.launches[0][0].shape) == (2, 1, 30, 64)
    torch.testing.assert_close(out.float(), original(block, x), **KERNEL_TOL)


def test_fallback_path_without_a_gpu_matches_the_original(patch):
    module, block = cross_attention().float(), attn_block().float()
    x, context, image = torch.randn(2, 64, 320), torch.randn(2, 77, 96), torch.randn(1, 64, 4, 4)
    reference = (original(module, x, context), original(block, image))
    patch.apply()
    with torch.no_grad():
        out = (module(x, context), block(image))
    torch.testing.assert_close(out[0], reference[0], **EXACT_TOL)
    torch.testing.assert_close(out[1], reference[1], **EXACT_TOL)
    assert rdna_flash_attn.stats()["kernel"] == 0
    assert rdna_flash_attn.stats()["fallback_reasons"] == {"CPU tensors (the kernels run on AMD RDNA3/RDNA4 GPUs)": 2}


def test_hypernetworks_transform_keys_and_values(patch, fake_gpu):
    from modules import shared

    torch.manual_seed(2)
    layer_k, layer_v = torch.nn.Linear(96, 96).half(), torch.nn.Linear(96, 96).half()
    shared.loaded_hypernetworks.append(type("Hypernetwork", (), {"layers": {96: (layer_k, layer_v)}})())
    module = cross_attention()
    x, context = torch.randn(2, 64, 320).half(), torch.randn(2, 77, 96).half()
    # The original forward with the hypernetwork folded into the key and value projections:
    folded = copy.deepcopy(module)
    folded.to_k = torch.nn.Sequential(layer_k, module.to_k)
    folded.to_v = torch.nn.Sequential(layer_v, module.to_v)
    patch.apply()
    with torch.no_grad():
        out = module(x, context)
        plain = original(module, x, context)
    assert len(fake_gpu.launches) == 1
    torch.testing.assert_close(out.float(), original(folded, x, context), **KERNEL_TOL)
    assert (out.float() - plain).abs().max() > 10 * KERNEL_TOL["atol"]  # the hook changed the result


def test_upcast_attn_runs_attention_in_float32_as_a1111_does(patch, fake_gpu):
    from modules import shared

    shared.opts.upcast_attn = True
    module = cross_attention()
    x, context = torch.randn(2, 64, 320).half(), torch.randn(2, 77, 96).half()
    patch.apply()
    with torch.no_grad():
        out = module(x, context)
    # float32 inputs outside autocast: the kernels take none, SDPA runs them in float32 (A1111's "sdp").
    assert out.dtype == torch.float16 and not fake_gpu.launches
    assert list(rdna_flash_attn.stats()["fallback_reasons"]) == [
        "float32 inputs (RDNA_FA_FP32_CAST=bf16 runs them on the kernels in bfloat16)"
    ]
    torch.testing.assert_close(out.float(), original(module, x, context), **KERNEL_TOL)


def test_unsupported_head_dim_falls_back_per_call(patch, fake_gpu):
    unsupported, supported = cross_attention(heads=4, dim_head=20), cross_attention()
    x, context = torch.randn(2, 64, 320).half(), torch.randn(2, 77, 96).half()
    patch.apply()
    with torch.no_grad():
        out = unsupported(x, context)
        supported(x, context)
    stats = rdna_flash_attn.stats()
    assert stats["kernel"] == 1 and stats["fallback"] == 1
    assert "head dim" in next(iter(stats["fallback_reasons"]))
    torch.testing.assert_close(out.float(), original(unsupported, x, context), **KERNEL_TOL)


def test_a_mask_goes_to_the_replaced_forward_unchanged(patch, fake_gpu):
    module = cross_attention().float()
    x, context = torch.randn(2, 64, 320), torch.randn(2, 77, 96)
    mask = torch.rand(2, 77) > 0.3
    reference = original(module, x, context, mask=mask)
    patch.apply()
    with torch.no_grad():
        out = module(x, context, mask=mask)
    assert not fake_gpu.launches and rdna_flash_attn.stats()["fallback"] == 0
    torch.testing.assert_close(out, reference, **EXACT_TOL)


def test_refused_calls_fall_back_to_the_optimization_installed_before(patch, fake_gpu):
    from modules import sd_hijack_optimizations as builtin

    builtin.SdOptimizationSdp().apply()
    patch.apply()
    module = cross_attention().float()  # refused: float32 (ldm's own forward runs only in float32 on a CPU)
    with torch.no_grad():
        module(torch.randn(1, 16, 320), torch.randn(1, 77, 96))
        cross_attention()(torch.randn(1, 16, 320).half(), torch.randn(1, 77, 96).half())  # runs on the kernels
    assert builtin.calls["cross_attention"] == 1 and len(fake_gpu.launches) == 1
    patch.undo()
    assert ldm_attention.CrossAttention.forward is builtin.sdp_cross_attention_forward
    assert ldm_model.AttnBlock.forward is builtin.sdp_attn_block_forward


def test_settings_toggles_route_per_call(patch, fake_gpu):
    module, block = cross_attention(), attn_block()
    x, context, image = torch.randn(1, 16, 320).half(), torch.randn(1, 77, 96).half(), torch.randn(1, 64, 4, 4).half()
    patch.apply()
    with torch.no_grad():
        options.apply("rdna_fa_unet", False)
        out = module(x, context)
        block(image)
        options.apply("rdna_fa_vae", False)
        options.apply("rdna_fa_unet", True)
        module(x, context)
        block(image)
    assert [tuple(launch[0].shape) for launch in fake_gpu.launches] == [(1, 1, 16, 64), (1, 8, 16, 40)]
    torch.testing.assert_close(out.float(), original(module, x, context), **KERNEL_TOL)


def test_training_backward_runs_on_the_kernels_only_while_the_toggle_is_on(patch, fake_gpu):
    module = cross_attention()
    context = torch.randn(1, 77, 96).half()
    patch.apply()
    for training in (True, False):
        options.apply("rdna_fa_training", training)
        x = torch.randn(1, 32, 320).half().requires_grad_()
        module(x, context).float().square().sum().backward()
        x_ref = x.detach().float().requires_grad_()
        original(module, x_ref, context).square().sum().backward()
        torch.testing.assert_close(x.grad.float(), x_ref.grad, atol=5e-3, rtol=2e-2)
    assert fake_gpu.differentiable_launches == 1
    assert list(rdna_flash_attn.stats()["fallback_reasons"]) == ["gradients needed and RDNA_FA_TRAINING=0"]


def test_sgm_twins_are_patched_and_keep_their_extra_arguments(patch, fake_gpu):
    import sgm.modules.attention
    import sgm.modules.diffusionmodules.model

    found = (sgm.modules.attention.CrossAttention.forward, sgm.modules.diffusionmodules.model.AttnBlock.forward)
    torch.manual_seed(3)
    module = sgm.modules.attention.CrossAttention(320, heads=8, dim_head=40).half()
    x, extra = torch.randn(1, 16, 320).half(), torch.randn(1, 4, 320).half()
    with torch.no_grad():
        reference, reference_extra = module(x), module(x, additional_tokens=extra)
        patch.apply()
        assert sgm.modules.attention.CrossAttention in patch.installed
        out, out_extra = module(x), module(x, additional_tokens=extra)
    assert len(fake_gpu.launches) == 1  # additional_tokens: sgm's own forward, as found
    torch.testing.assert_close(out, reference, **KERNEL_TOL)
    torch.testing.assert_close(out_extra, reference_extra, atol=0, rtol=0)
    patch.undo()
    assert (sgm.modules.attention.CrossAttention.forward, sgm.modules.diffusionmodules.model.AttnBlock.forward) == found


def test_undo_restores_the_exact_functions(patch):
    before = {cls: cls.forward for cls in a1111_originals}
    patch.apply()
    patch.apply()  # applying twice must not capture our own forwards as "found"
    assert all(cls.forward is not before[cls] for cls in before)
    patch.undo()
    assert all(cls.forward is before[cls] for cls in before)
    patch.undo()
    assert all(cls.forward is before[cls] for cls in before)
