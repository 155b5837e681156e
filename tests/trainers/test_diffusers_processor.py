"""RdnaFlashAttnProcessor on diffusers models: install and restore are exact, and outputs and
gradients match diffusers' own processors, on the kernels (fake GPU) and on the SDPA fallback."""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, UNet2DConditionModel
from diffusers.models.attention_processor import (
    Attention,
    AttnProcessor,
    AttnProcessor2_0,
)

import rdna_flash_attn
from rdna_flash_attn.integrations.diffusers_attention import (
    RdnaFlashAttnProcessor,
    attention_processor_installed,
    install_attention_processor,
    restore_attention_processors,
)
from rdna_fa_lab.hosts import diffusers_harness

TORCH_SDPA = F.scaled_dot_product_attention


def tiny_unet() -> UNet2DConditionModel:
    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, norm_num_groups=8,
        block_out_channels=(16, 32), attention_head_dim=2, cross_attention_dim=16,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    )


def tiny_vae() -> AutoencoderKL:
    """AutoencoderKL whose mid-block attention is single-head over 32 channels of a (B, C, H, W) map,
    with group norm, residual connection and output rescale, as in SD's VAE."""
    torch.manual_seed(0)
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(16, 32), layers_per_block=1,
        norm_num_groups=8, down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
    )


class CustomProcessor(AttnProcessor2_0):
    """Stands for a processor that computes something else (IP-Adapter, custom LoRA): never replaced."""


def relative_error(actual, expected):
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def test_install_and_restore_are_exact():
    unet = tiny_unet()
    custom = CustomProcessor()
    name_of_custom = next(iter(unet.attn_processors))
    unet.set_attn_processor({name: custom if name == name_of_custom else AttnProcessor2_0()
                             for name in unet.attn_processors})
    before = unet.attn_processors

    returned = install_attention_processor(unet)
    installed = unet.attn_processors
    assert returned == before and all(returned[n] is before[n] for n in before)
    assert installed[name_of_custom] is custom  # not a plain SDPA processor: kept
    others = [p for n, p in installed.items() if n != name_of_custom]
    assert others and all(isinstance(p, RdnaFlashAttnProcessor) for p in others)
    assert len({id(p) for p in others}) == 1 and attention_processor_installed(unet)

    install_attention_processor(unet)  # twice: restore still brings back the first originals
    restore_attention_processors(unet)
    after = unet.attn_processors
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert not attention_processor_installed(unet)
    with pytest.raises(ValueError, match="no processors saved"):
        restore_attention_processors(unet)
    assert "_rdna_flash_attn_previous_processors" not in dict(unet.state_dict())


def test_restore_from_the_returned_mapping():
    vae = tiny_vae()
    before = vae.attn_processors
    previous = install_attention_processor(vae)
    restore_attention_processors(vae, previous)
    assert all(vae.attn_processors[n] is before[n] for n in before)


def test_without_the_peft_backend_diffusers_keeps_its_processors(monkeypatch, caplog):
    """Old diffusers hands a LoRA `scale` to its processors, which ours would drop."""
    import diffusers.utils

    monkeypatch.setattr(diffusers.utils, "USE_PEFT_BACKEND", False)
    unet = tiny_unet()
    before = unet.attn_processors
    assert install_attention_processor(unet) == before
    assert all(unet.attn_processors[n] is before[n] for n in before) and not attention_processor_installed(unet)
    assert "PEFT backend" in caplog.text


def test_non_diffusers_model_is_refused():
    with pytest.raises(TypeError, match="patch_sdpa"):
        install_attention_processor(torch.nn.Linear(2, 2))


def unet_step(unet, sample, context):
    unet.zero_grad(set_to_none=True)
    out = unet(sample, torch.tensor([10]), context).sample
    out.square().mean().backward()
    grads = [p.grad for p in unet.parameters() if p.grad is not None]
    return out.detach(), grads


def test_unet_matches_diffusers_processor_on_the_kernels(fake_gpu):
    # float32 model; the kernels run the attention in fp16 (RDNA_FA_FP32_CAST=fp16) and accumulate
    # in float32: errors at fp16 input rounding, against diffusers' float32 SDPA.
    rdna_flash_attn.settings.fp32_cast = "fp16"
    unet = tiny_unet()
    sample, context = torch.randn(2, 4, 8, 8), torch.randn(2, 5, 16)
    expected, expected_grads = unet_step(unet, sample, context)
    install_attention_processor(unet)
    actual, actual_grads = unet_step(unet, sample, context)

    layers = len(unet.attn_processors)
    assert fake_gpu.differentiable_launches == layers and rdna_flash_attn.stats()["fallback"] == 0
    assert relative_error(actual, expected) < 1e-3
    assert len(actual_grads) == len(expected_grads)
    assert max(relative_error(a, e) for a, e in zip(actual_grads, expected_grads)) < 5e-3

    restore_attention_processors(unet)
    restored, _ = unet_step(unet, sample, context)
    assert torch.equal(restored, expected) and fake_gpu.differentiable_launches == layers


def test_unet_on_the_sdpa_fallback_equals_diffusers_processor():
    unet = tiny_unet()
    sample, context = torch.randn(1, 4, 8, 8), torch.randn(1, 5, 16)
    with torch.no_grad():
        expected = unet(sample, torch.tensor([10]), context).sample
        install_attention_processor(unet)
        actual = unet(sample, torch.tensor([10]), context).sample
    assert torch.allclose(actual, expected, rtol=0, atol=1e-6)
    assert rdna_flash_attn.stats()["fallback"] == len(unet.attn_processors)


def test_vae_spatial_attention_on_the_kernels(fake_gpu):
    rdna_flash_attn.settings.fp32_cast = "fp16"
    vae = tiny_vae()
    image = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        expected = vae(image).sample
        install_attention_processor(vae)
        actual = vae(image).sample
    assert len(fake_gpu.launches) == len(vae.attn_processors) == 2  # encoder and decoder mid-blocks
    q = fake_gpu.launches[0][0]
    assert q.shape == (1, 1, 64, 32)  # one head over the 8x8 map (one downsampling), 32 channels
    assert relative_error(actual, expected) < 1e-3


ATTENTION_LAYERS = {
    "spatial norm, residual, rescale": dict(query_dim=32, heads=1, dim_head=32, spatial_norm_dim=4,
                                            residual_connection=True, rescale_output_factor=2.0),
    "group norm on a feature map": dict(query_dim=32, heads=2, dim_head=16, norm_num_groups=8,
                                        residual_connection=True, _from_deprecated_attn_block=True),
    "cross-attention with layer-normed context": dict(query_dim=32, cross_attention_dim=24, heads=2, dim_head=16,
                                                      cross_attention_norm="layer_norm"),
    "q/k layer norm": dict(query_dim=32, heads=4, dim_head=8, qk_norm="layer_norm"),
    "custom scale": dict(query_dim=32, heads=2, dim_head=16, scale_qk=False),
}


def layer_inputs(config):
    spatial = "spatial_norm_dim" in config or "norm_num_groups" in config
    hidden = torch.randn(2, 32, 4, 6) if spatial else torch.randn(2, 12, 32)
    kwargs = {}
    if "spatial_norm_dim" in config:
        kwargs["temb"] = torch.randn(2, 4, 2, 3)
    if "cross_attention_dim" in config:
        kwargs["encoder_hidden_states"] = torch.randn(2, 7, 24)
    return hidden, kwargs


@pytest.mark.parametrize("name", ATTENTION_LAYERS)
def test_attention_layer_variants_match_diffusers_processor(fake_gpu, name):
    rdna_flash_attn.settings.fp32_cast = "fp16"
    torch.manual_seed(2)
    config = ATTENTION_LAYERS[name]
    layer = Attention(**config)
    hidden, kwargs = layer_inputs(config)
    # diffusers' own default for the layer: the SDPA processor, or the classic one where scale_qk=False
    expected_processor = AttnProcessor2_0 if config.get("scale_qk", True) else AttnProcessor
    assert type(layer.processor) is expected_processor
    with torch.no_grad():
        expected = layer(hidden, **kwargs)
        layer.set_processor(RdnaFlashAttnProcessor())
        actual = layer(hidden, **kwargs)
    assert actual.shape == expected.shape
    assert len(fake_gpu.launches) == 1 and relative_error(actual, expected) < 1e-3


@pytest.mark.parametrize("dim_head, on_kernels", [(64, True), (80, True), (256, False)])
def test_attention_mask_runs_on_the_kernels_where_a_masked_kernel_exists(fake_gpu, dim_head, on_kernels):
    torch.manual_seed(3)
    layer = Attention(query_dim=32, cross_attention_dim=24, heads=2, dim_head=dim_head).half()
    hidden, context = torch.randn(2, 12, 32).half(), torch.randn(2, 7, 24).half()
    mask = torch.zeros(2, 7).half()
    mask[:, -2:] = -10000.0  # diffusers' additive (batch, key tokens) mask
    with torch.no_grad():
        expected = layer(hidden, context, attention_mask=mask)
        layer.set_processor(RdnaFlashAttnProcessor())
        actual = layer(hidden, context, attention_mask=mask)
    assert relative_error(actual.float(), expected.float()) < 1e-3
    assert len(fake_gpu.launches) == on_kernels
    reasons = rdna_flash_attn.stats()["fallback_reasons"]
    assert reasons == {} if on_kernels else list(reasons)[0].startswith("attn_mask with head dim 256")


def tiny_flux():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=32, axes_dims_rope=(4, 4, 8))


def flux_inputs():
    return dict(hidden_states=torch.randn(1, 16, 4), encoder_hidden_states=torch.randn(1, 5, 32),
                pooled_projections=torch.randn(1, 32), timestep=torch.tensor([0.5]),
                img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(5, 3))


def test_transformer_models_keep_their_processors_with_sdpa_routed_while_they_run(fake_gpu):
    """Flux's own processors (diffusers' attention_dispatch, "native" backend) stay; their SDPA calls
    reach the kernels while the layers run, and torch's SDPA is itself again outside them."""
    rdna_flash_attn.settings.fp32_cast = "fp16"
    flux = tiny_flux()
    inputs = flux_inputs()
    before = flux.attn_processors
    with torch.no_grad():
        expected = flux(**inputs).sample
        install_attention_processor(flux)
        assert all(flux.attn_processors[n] is before[n] for n in before) and attention_processor_installed(flux)
        actual = flux(**inputs).sample
    assert len(fake_gpu.launches) == 2  # the joint block and the single block
    assert relative_error(actual, expected) < 1e-3
    assert F.scaled_dot_product_attention is TORCH_SDPA

    restore_attention_processors(flux)
    assert not attention_processor_installed(flux)
    with torch.no_grad():
        flux(**inputs)
    assert len(fake_gpu.launches) == 2 and all(flux.attn_processors[n] is before[n] for n in before)


def test_models_without_a_processor_registry_keep_their_processors_with_sdpa_routed(fake_gpu):
    """Lumina 2's transformer has attention layers with processors but no attn_processors: each layer is
    routed while it runs, its processor untouched, and restore takes the hooks off."""
    rdna_flash_attn.settings.fp32_cast = "fp16"
    lumina = diffusers_harness.build("lumina2", torch.device("cpu"))
    inputs = diffusers_harness.inputs("lumina2", torch.device("cpu"))
    before = {f"{name}.processor": module.processor for name, module in lumina.named_modules()
              if hasattr(module, "processor")}
    with torch.no_grad():
        expected = diffusers_harness.forward(lumina, "lumina2", inputs)
        previous = install_attention_processor(lumina)
        assert attention_processor_installed(lumina) and len(previous) == len(before) == 3
        actual = diffusers_harness.forward(lumina, "lumina2", inputs)
    assert len(fake_gpu.launches) == 3 and relative_error(actual, expected) < 1e-3
    assert previous == before
    assert F.scaled_dot_product_attention is TORCH_SDPA
    lumina.get_submodule(next(iter(before)).removesuffix(".processor")).processor = "replaced since"
    restore_attention_processors(lumina, previous)
    assert not attention_processor_installed(lumina)
    assert all(module.processor is before[f"{name}.processor"] for name, module in lumina.named_modules()
               if f"{name}.processor" in before)
    with torch.no_grad():
        diffusers_harness.forward(lumina, "lumina2", inputs)
    assert len(fake_gpu.launches) == 3


def sdpa_in_fp16(query, key, value, *args, **kwargs):
    """torch's SDPA on the fp16-rounded inputs, in fp16: the kernels' precision (fp32_cast=fp16)."""
    return TORCH_SDPA(query.half(), key.half(), value.half(), *args, **kwargs).to(query.dtype)


def test_transformer_gradients_on_the_kernels_are_as_close_as_fp16_sdpa(fake_gpu, monkeypatch):
    """Per parameter, the gradient error against float32 SDPA is within 2x (plus a floor far below
    the gradients' size) of the error torch's own SDPA makes in fp16: the text-query parameters' tiny
    gradients are rounded as much by either."""
    rdna_flash_attn.settings.fp32_cast = "fp16"
    flux = tiny_flux()
    inputs = flux_inputs()

    def step():
        flux.zero_grad(set_to_none=True)
        flux(**inputs).sample.square().mean().backward()
        return {name: p.grad for name, p in flux.named_parameters() if p.grad is not None}

    exact = step()
    with monkeypatch.context() as patched:
        patched.setattr(F, "scaled_dot_product_attention", sdpa_in_fp16)
        rounded = step()
    install_attention_processor(flux)
    actual = step()
    assert fake_gpu.differentiable_launches == 2 and rdna_flash_attn.stats()["fallback"] == 0
    assert actual.keys() == exact.keys()
    for name in exact:
        assert relative_error(actual[name], exact[name]) <= 2 * relative_error(rounded[name], exact[name]) + 1e-4, name


def test_a_routed_model_deep_copies_and_the_copy_is_routed(fake_gpu):
    """Trainers copy models (EMA, reference models): the hooks must not make that fail."""
    rdna_flash_attn.settings.fp32_cast = "fp16"
    flux = tiny_flux()
    install_attention_processor(flux)
    copy = deepcopy(flux)
    with torch.no_grad():
        copy(**flux_inputs())
    assert len(fake_gpu.launches) == 2 and attention_processor_installed(copy)
    restore_attention_processors(copy)  # the copy's own hooks go, the original keeps its
    assert not attention_processor_installed(copy) and attention_processor_installed(flux)
    with torch.no_grad():
        copy(**flux_inputs())
        flux(**flux_inputs())
    assert len(fake_gpu.launches) == 4


def test_a_layer_that_raises_leaves_torch_sdpa_as_it_was():
    flux = tiny_flux()
    install_attention_processor(flux)
    layer = flux.get_submodule(next(iter(flux.attn_processors)).removesuffix(".processor"))
    with pytest.raises(AttributeError):  # the joint block's layer without the text tokens it needs
        layer(torch.randn(1, 4, 32))
    assert F.scaled_dot_product_attention is TORCH_SDPA
    rdna_flash_attn.enable_sdpa_patch()  # an explicit enable outlives the layers' scopes
    with torch.no_grad():
        flux(**flux_inputs())
    assert rdna_flash_attn.sdpa_patch_enabled()
