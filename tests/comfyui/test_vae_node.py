"""The VAE node on a tiny ComfyUI VAE (comfy.sd.VAE around an AutoencoderKL with the real attention
blocks, random weights), decoding in float32 as ComfyUI does on the CPU."""

from __future__ import annotations

import gc

import pytest
import torch

import rdna_flash_attn
from rdna_flash_attn.config import settings

from rdna_fa_lab.hosts.comfyui_harness import initialise

DDCONFIG = dict(double_z=True, z_channels=4, resolution=64, in_channels=3, out_ch=3, ch=32, ch_mult=[1, 2],
                num_res_blocks=1, attn_resolutions=[], dropout=0.0)
IMAGE_TOLERANCE = dict(atol=2e-2, rtol=0)  # images in [0, 1]; attention in bf16 instead of float32


def decode(vae, latent):
    """VAE.decode as ComfyUI's executor runs nodes: under torch.inference_mode."""
    with torch.inference_mode():
        return vae.decode(latent)


@pytest.fixture
def vae():
    import comfy.sd
    from comfy.ldm.models.autoencoder import AutoencoderKL

    donor = AutoencoderKL(ddconfig=DDCONFIG, embed_dim=4)
    initialise(donor, seed=7)
    with torch.no_grad():
        donor.decoder.conv_out.weight.mul_(8)  # images spread over [0, 1] (std ~0.2), not a flat grey
    return comfy.sd.VAE(sd=donor.state_dict(), config={"params": dict(ddconfig=DDCONFIG, embed_dim=4)})


@pytest.fixture
def latent():
    return torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(3))


def attention_functions(vae):
    return [m.optimized_attention for m in vae.first_stage_model.modules() if hasattr(m, "optimized_attention")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_vae_reaches_the_kernels(dtype, latent, vae_node, fake_gpu):
    # ComfyUI runs the VAE in bf16 or fp16 on most GPUs: its attention inputs are then strided views
    # already in the run type, which the node must still lay out with unit stride over the channels.
    import comfy.sd
    from comfy.ldm.models.autoencoder import AutoencoderKL

    donor = AutoencoderKL(ddconfig=DDCONFIG, embed_dim=4)
    initialise(donor, seed=7)
    vae = comfy.sd.VAE(sd=donor.state_dict(), config={"params": dict(ddconfig=DDCONFIG, embed_dim=4)}, dtype=dtype)
    reference = decode(vae, latent)
    (patched,) = vae_node.patch(vae, True, "bf16", "off")
    image = decode(patched, latent)
    assert len(fake_gpu.launches) == 1 and fake_gpu.launches[0][0].dtype == dtype
    assert rdna_flash_attn.stats()["fallback"] == 0
    torch.testing.assert_close(image.float(), reference.float(), **IMAGE_TOLERANCE)


@pytest.mark.parametrize("precision", ["bf16", "fp16 if in range"])
def test_patched_vae_decode_matches_and_reports_psnr(precision, vae, latent, vae_node, fake_gpu, log_records):
    reference = decode(vae, latent)
    (patched,) = vae_node.patch(vae, True, precision, "first decode")
    image = decode(patched, latent)
    torch.testing.assert_close(image, reference, **IMAGE_TOLERANCE)
    assert len(fake_gpu.launches) == 1  # the decoder's mid-block attention (the reference decode adds none)
    expected_dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    assert fake_gpu.launches[0][0].dtype == expected_dtype and fake_gpu.launches[0][0].shape == (1, 1, 64, 64)
    routing = patched.rdna_flash_attn_routing
    assert 30 < routing.last_psnr < float("inf")
    assert sum("decoded image PSNR" in r.getMessage() for r in log_records.records) == 1
    decode(patched, latent)  # "first decode": no second comparison
    assert routing.decodes == 2 and len(fake_gpu.launches) == 2
    assert sum("decoded image PSNR" in r.getMessage() for r in log_records.records) == 1


def test_a_decode_whose_attention_fell_back_gets_no_psnr_line_and_no_second_decode(vae, latent, vae_node,
                                                                                   log_records, monkeypatch):
    # No GPU stand-in: the CPU tensors fall back to the VAE's own attention.
    reference = decode(vae, latent)
    (patched,) = vae_node.patch(vae, True, "bf16", "every decode")
    decodes = []
    monkeypatch.setattr(patched.first_stage_model, "decode", _counting(patched.first_stage_model.decode, decodes))
    torch.testing.assert_close(decode(patched, latent), reference, atol=0, rtol=0)
    assert len(decodes) == 1 and patched.rdna_flash_attn_routing.last_psnr is None
    messages = [r.getMessage() for r in log_records.records]
    assert not any("decoded image PSNR" in m for m in messages)
    assert any(m.startswith("RDNA Flash Attention: not using the kernels: CPU tensors") and
               m.endswith("(the VAE's own attention runs these calls)") for m in messages)
    assert any("did not run on the kernels, so there is no PSNR check" in m for m in messages)


def _counting(function, calls: list):
    def counted(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    return counted


def test_input_vae_is_unchanged_and_originals_return(vae, latent, vae_node, fake_gpu):
    originals = attention_functions(vae)
    reference = decode(vae, latent)
    (patched,) = vae_node.patch(vae, True, "bf16", "off")
    decode(patched, latent)
    assert len(fake_gpu.launches) == 1
    assert torch.equal(decode(vae, latent), reference) and len(fake_gpu.launches) == 1
    (bypassed,) = vae_node.patch(vae, False, "bf16", "off")
    assert bypassed is vae
    del patched
    gc.collect()
    assert attention_functions(vae) == originals


def test_keep_fp32_follows_the_dispatch_policy(vae, latent, vae_node, fake_gpu):
    reference = decode(vae, latent)
    (patched,) = vae_node.patch(vae, True, "keep fp32", "off")
    assert torch.equal(decode(patched, latent), reference) and fake_gpu.launches == []
    assert list(rdna_flash_attn.stats()["fallback_reasons"]) == [
        "float32 inputs (RDNA_FA_FP32_CAST=bf16 runs them on the kernels in bfloat16)"]


def test_cpu_vae_runs_the_original_attention(vae, latent, vae_node):
    reference = decode(vae, latent)
    (patched,) = vae_node.patch(vae, True, "bf16", "off")
    assert torch.equal(decode(patched, latent), reference)
    assert rdna_flash_attn.stats()["kernel"] == 0 and rdna_flash_attn.stats()["fallback"] == 1


def test_an_error_in_the_vae_routing_runs_the_original_attention(vae, latent, vae_node, node_package, fake_gpu,
                                                                  log_records, monkeypatch):
    def broken_dtype_decision(*args):
        raise RuntimeError("a fault in the routing code")

    monkeypatch.setattr(node_package.vae_patch, "_run_dtype", broken_dtype_decision)
    reference = decode(vae, latent)
    (patched,) = vae_node.patch(vae, True, "bf16", "off")
    for _ in range(2):
        assert torch.equal(decode(patched, latent), reference)
    assert fake_gpu.launches == []
    reason = "error in the node's routing code (RuntimeError)"
    assert node_package.routing.comfy_fallbacks == {reason: 2}
    assert sum(reason in r.getMessage() for r in log_records.records) == 1


@pytest.mark.parametrize("training", [True, False])
def test_backward_through_the_patched_vae(training, vae, latent, vae_node, node_package, fake_gpu):
    settings.training = training
    (patched,) = vae_node.patch(vae, True, "bf16", "off")
    z = latent.clone().requires_grad_()
    with node_package.routing.context_value(node_package.vae_patch._active, patched.rdna_flash_attn_routing):
        patched.first_stage_model.decode(z).square().mean().backward()
    reference_z = latent.clone().requires_grad_()
    vae.first_stage_model.decode(reference_z).square().mean().backward()
    torch.testing.assert_close(z.grad, reference_z.grad, atol=2e-2 * float(reference_z.grad.abs().max()), rtol=0.1)
    assert fake_gpu.differentiable_launches == (1 if training else 0)
    if not training:
        assert list(rdna_flash_attn.stats()["fallback_reasons"]) == ["gradients needed and RDNA_FA_TRAINING=0"]


def test_psnr_exposes_a_wrong_kernel(vae, latent, vae_node, fake_gpu):
    (patched,) = vae_node.patch(vae, True, "bf16", "every decode")
    decode(patched, latent)
    good = patched.rdna_flash_attn_routing.last_psnr
    fake_gpu.error = 0.5  # a kernel whose every output is off by 0.5
    decode(patched, latent)
    assert patched.rdna_flash_attn_routing.last_psnr < good - 20
