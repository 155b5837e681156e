"""The A1111 forwards on real ldm (stable-diffusion-sdkit): outputs equal the originals' on the
kernel path (fake_gpu) and on the fallback path, hypernetworks and upcast_attn as A1111's own
optimizations apply them, per-call fallbacks, training, and undo restoring the exact functions."""

from __future__ import annotations

import copy
import logging

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
def sdpa_calls(monkeypatch):
    """Shapes of the queries of every torch SDPA call (the replaced forwards never call it)."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counting(query, *args, **kwargs):
        calls.append(tuple(query.shape))
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counting)
    return calls


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


def test_a_mask_runs_on_sdpa_with_ldms_meaning(patch, fake_gpu, sdpa_calls):
    module = cross_attention().float()
    x, context = torch.randn(2, 64, 320), torch.randn(2, 77, 96)
    mask = torch.rand(2, 77) > 0.3
    no_key_left = mask.clone()
    no_key_left[1] = False  # ldm then averages every value; SDPA would not: the replaced forward runs
    reference = original(module, x, context, mask=mask), original(module, x, context, mask=no_key_left)
    patch.apply()
    with torch.no_grad():
        out = module(x, context, mask=mask), module(x, context, mask=no_key_left)
    assert not fake_gpu.launches and rdna_flash_attn.stats()["fallback"] == 1  # float32: refused by the kernels
    assert sdpa_calls == [(2, 8, 64, 40)]
    torch.testing.assert_close(out[0], reference[0], **EXACT_TOL)
    torch.testing.assert_close(out[1], reference[1], **EXACT_TOL)


def test_a_key_mask_runs_on_the_kernels_at_a_masked_head_dim(patch, fake_gpu):
    module = cross_attention(heads=5, dim_head=64)
    x, context = torch.randn(2, 64, 320).half(), torch.randn(2, 77, 96).half()
    mask = torch.rand(2, 77, generator=torch.Generator().manual_seed(4)) > 0.3
    reference = original(module, x, context, mask=mask)
    patch.apply()
    with torch.no_grad():
        out = module(x, context, mask=mask)
    assert len(fake_gpu.launches) == 1 and rdna_flash_attn.stats()["fallback"] == 0
    torch.testing.assert_close(out.float(), reference, **KERNEL_TOL)


def test_a_mask_goes_to_an_optimization_installed_before_unchanged(patch, fake_gpu):
    from modules import sd_hijack_optimizations as builtin

    builtin.SdOptimizationSdp().apply()
    module = cross_attention().float()
    x, context, mask = torch.randn(2, 64, 320), torch.randn(2, 77, 96), torch.rand(2, 77) > 0.3
    reference = original(module, x, context, mask=mask)
    patch.apply()
    with torch.no_grad():
        out = module(x, context, mask=mask)
    assert builtin.calls["cross_attention"] == 1 and not fake_gpu.launches
    torch.testing.assert_close(out, reference, **EXACT_TOL)


def test_refused_calls_after_a1111s_undo_run_sdpa_not_its_einsum_forward(patch, fake_gpu, sdpa_calls):
    """A1111 runs undo_optimizations() before every apply(): the patch then finds A1111's einsum
    CrossAttention forward (ldm's and sgm's) and ldm's AttnBlock forward (sgm's too)."""
    import sgm.modules.attention
    import sgm.modules.diffusionmodules.model
    from modules import sd_hijack
    from modules.hypernetworks import hypernetwork

    sgm_own = (sgm.modules.attention.CrossAttention.forward, sgm.modules.diffusionmodules.model.AttnBlock.forward)
    sd_hijack.undo_optimizations()
    assert ldm_attention.CrossAttention.forward is hypernetwork.attention_CrossAttention_forward
    assert sgm.modules.diffusionmodules.model.AttnBlock.forward is a1111_originals[ldm_model.AttnBlock]
    patch.apply()
    torch.manual_seed(4)
    x, context, mask = torch.randn(1, 16, 320), torch.randn(1, 77, 96), torch.rand(1, 77) > 0.3
    image = torch.randn(1, 64, 4, 4)
    ldm_module, head_dim_20 = cross_attention().float(), cross_attention(heads=4, dim_head=20)
    sgm_module = sgm.modules.attention.CrossAttention(320, heads=8, dim_head=40)
    ldm_block, sgm_block = attn_block().float(), sgm.modules.diffusionmodules.model.AttnBlock(64)
    with torch.no_grad():
        expected = {
            "float32": original(ldm_module, x, context),
            "mask": original(ldm_module, x, context, mask=mask),
            "head dim": original(head_dim_20, x, context),
            "sgm": sgm_own[0](sgm_module, x),
            "attn block": original(ldm_block, image),
            "sgm attn block": sgm_own[1](sgm_block, image),
        }
        assert not sdpa_calls  # the references use none
        out = {
            "float32": ldm_module(x, context),  # refused: float32 (as under --no-half)
            "mask": ldm_module(x, context, mask=mask),
            "head dim": head_dim_20(x.half(), context.half()).float(),
            "sgm": sgm_module(x),
            "attn block": ldm_block(image),
            "sgm attn block": sgm_block(image),
        }
        options.apply("rdna_fa_unet", False)
        unet_off = cross_attention()(x.half(), context.half())
    assert hypernetwork.calls["attention_CrossAttention_forward"] == 0 and not fake_gpu.launches
    assert sdpa_calls == [(1, 8, 16, 40), (1, 8, 16, 40), (1, 4, 16, 20), (1, 8, 16, 40), (1, 1, 16, 64),
                          (1, 1, 16, 64), (1, 8, 16, 40)]
    assert unet_off.dtype == torch.float16
    for name, reference in expected.items():
        tolerance = KERNEL_TOL if name == "head dim" else EXACT_TOL
        torch.testing.assert_close(out[name], reference, **tolerance, msg=lambda text, name=name: f"{name}: {text}")


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


def test_our_failure_is_logged_once_and_the_replaced_forward_runs(patch, fake_gpu, monkeypatch, log_records):
    def broken(*args, **kwargs):
        raise RuntimeError("wrapper broke")

    monkeypatch.setattr(rdna_flash_attn, "attention_or_reason", broken)
    module, block = cross_attention().float(), attn_block().float()
    x, context, image = torch.randn(1, 16, 320), torch.randn(1, 77, 96), torch.randn(1, 64, 4, 4)
    patch.apply()
    with torch.no_grad():
        out = [module(x, context), module(x, context), block(image)]
    torch.testing.assert_close(out[0], original(module, x, context), **EXACT_TOL)
    torch.testing.assert_close(out[1], out[0], atol=0, rtol=0)
    torch.testing.assert_close(out[2], original(block, image), **EXACT_TOL)
    warnings = [r.message for r in log_records.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("RuntimeError: wrapper broke" in line for line in warnings)
    assert "CrossAttention" in warnings[0] and "AttnBlock" in warnings[1]


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_the_log_setting_shows_reasons_first_seen_while_it_was_off(patch, caplog):
    caplog.set_level(logging.WARNING)  # the root logger as hosts leave it: INFO not shown
    collect = _Collect()
    logger = logging.getLogger("rdna_flash_attn")
    logger.addHandler(collect)
    try:
        module = cross_attention().float()
        x, context = torch.randn(1, 16, 320), torch.randn(1, 77, 96)
        patch.apply()
        with torch.no_grad():
            module(x, context)  # CPU tensors: refused while the setting is off
            assert collect.messages == []
            options.apply("rdna_fa_log_fallbacks", True)
            assert options.current("rdna_fa_log_fallbacks") and logger.isEnabledFor(logging.INFO)
            module(x, context)
            module(x, context)
        options.apply("rdna_fa_log_fallbacks", False)
        assert not logger.isEnabledFor(logging.INFO) and not options.current("rdna_fa_log_fallbacks")
    finally:
        logger.removeHandler(collect)
    assert collect.messages == ["RDNA Flash Attention: not using the kernels: CPU tensors (the kernels run on AMD "
                                "RDNA3/RDNA4 GPUs) (PyTorch SDPA runs these calls)"]
    assert rdna_flash_attn.stats()["fallback"] == 3
