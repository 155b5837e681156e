"""reForge and Forge Classic through their call signatures (fakes of ldm_patched/): the attention
function the UNet looks up at call time and every module that bound it at import route to the kernels,
each loaded model's VAE blocks too, refused calls run the host's function with their own arguments,
and unloading puts everything back."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from pathlib import Path

import pytest
import torch

import rdna_flash_attn
from extension import entry, options, reforge
from rdna_fa_lab.hosts import webui_harness
from rdna_fa_lab.hosts.comfyui_harness import initialise, take_off_path

from .. import seeds

KERNEL_TOL = dict(atol=2e-3, rtol=1e-2)  # fp16 kernels (float32 math) vs the host's SDPA on fp16 inputs


@pytest.fixture
def ldm_patched(webui):
    """reForge with its attention modules loaded; returns ldm_patched.ldm.modules.attention."""
    webui("reforge")
    importlib.import_module("ldm_patched.contrib.nodes_sag")
    return importlib.import_module("ldm_patched.ldm.modules.attention")


def qkv(heads=8, dim=40, tokens=64, context=77):
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(2, tokens, heads * dim, generator=generator).half(),
            torch.randn(2, context, heads * dim, generator=generator).half(),
            torch.randn(2, context, heads * dim, generator=generator).half())


def test_detected_as_reforge_and_the_unet_runs_on_the_kernels(ldm_patched, fake_gpu):
    assert entry.setup() == "reforge"
    q, k, v = qkv()
    out = ldm_patched.cross_attention(q, k, v, 8)
    assert len(fake_gpu.launches) == 1 and ldm_patched.calls["optimized_attention"] == 0
    torch.testing.assert_close(out.float(), ldm_patched.attention_pytorch(q.float(), k.float(), v.float(), 8),
                               **KERNEL_TOL)
    sag = sys.modules["ldm_patched.contrib.nodes_sag"]  # bound the function at import
    sag.attention_with_guidance(q, k, v, 8)
    assert len(fake_gpu.launches) == 2


def test_refused_calls_run_the_hosts_function_with_their_own_arguments(ldm_patched, fake_gpu):
    entry.setup()
    q, k, v = qkv()
    mask = torch.ones(64, 77, dtype=torch.bool)  # bool: some of reForge's backends read it as key padding
    ldm_patched.cross_attention(q, k, v, 8, mask=mask)
    assert fake_gpu.launches == [] and ldm_patched.calls["optimized_attention"] == 1
    # Forge Classic's functions take (q, k, v, heads, mask=None) only: nothing else is passed on.
    seen = []

    def classic_attention(q, k, v, heads, mask=None):
        seen.append(mask)
        return ldm_patched.attention_pytorch(q, k, v, heads, mask)

    reforge.routed_attention_function(classic_attention)(q.float(), k.float(), v.float(), 8)  # float32: refused
    assert seen == [None]


def three_d_bias(batch=2, tokens=64, context=77):
    """A (batch, queries, keys) float mask, as reForge's Flux gets a style model's attention bias."""
    return torch.randn(batch, tokens, context, generator=torch.Generator().manual_seed(4)).half()


def test_a_three_dimensional_float_mask_runs_on_the_kernels_read_as_reforge_reads_it(ldm_patched, fake_gpu):
    entry.setup()
    q, k, v = qkv()
    mask = three_d_bias()
    out = ldm_patched.cross_attention(q, k, v, 8, mask=mask)
    # one call of reForge's own function: the probe of how it reads 3-D masks, on a tiny CPU input
    assert len(fake_gpu.launches) == 1 and ldm_patched.calls["optimized_attention"] == 1
    host = ldm_patched.attention_pytorch(q.float(), k.float(), v.float(), 8, mask.float())
    torch.testing.assert_close(out.float(), host, **KERNEL_TOL)  # SDPA would read it as (heads, queries, keys)
    ldm_patched.cross_attention(q, k, v, 8, mask=mask)
    assert len(fake_gpu.launches) == 2 and ldm_patched.calls["optimized_attention"] == 2  # asked once


def test_a_host_function_reading_three_dimensional_masks_heads_first_keeps_them(ldm_patched, fake_gpu, monkeypatch):
    # Forge Classic's PyTorch backend (and older reForge's) hands a 3-D mask to SDPA as it is
    def heads_first_attention(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False):
        ldm_patched.calls["optimized_attention"] += 1
        b, _, width = q.shape
        q, k, v = (t.view(b, -1, heads, width // heads).transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, -1, width)

    monkeypatch.setattr(ldm_patched, "optimized_attention", heads_first_attention)
    monkeypatch.setattr(ldm_patched, "optimized_attention_masked", heads_first_attention)
    entry.setup()
    q, k, v = qkv()
    mask = three_d_bias(batch=8)  # one (queries, keys) mask per head
    out = ldm_patched.cross_attention(q, k, v, 8, mask=mask)
    assert fake_gpu.launches == [] and ldm_patched.calls["optimized_attention"] == 2  # the probe, then the call
    torch.testing.assert_close(out, heads_first_attention(q, k, v, 8, mask=mask))


def test_vae_blocks_of_a_loaded_model_route_and_come_back(ldm_patched, fake_gpu):
    from modules import script_callbacks

    model_module = importlib.import_module("ldm_patched.ldm.modules.diffusionmodules.model")
    entry.setup()
    model = torch.nn.Sequential(model_module.AttnBlock())
    script_callbacks.model_loaded_callback(model)
    q, k, v = (torch.randn(1, 64, 8, 8, generator=torch.Generator().manual_seed(s)).half() for s in range(3))
    out = model[0](q, k, v)
    assert len(fake_gpu.launches) == 1 and model_module.calls["vae_attention"] == 0
    torch.testing.assert_close(out.float(), model_module.pytorch_attention(q.float(), k.float(), v.float()), **KERNEL_TOL)
    script_callbacks.script_unloaded_callback()
    assert model[0].optimized_attention is model_module.pytorch_attention
    assert ldm_patched.optimized_attention is ldm_patched.attention_pytorch
    assert sys.modules["ldm_patched.contrib.nodes_sag"].optimized_attention is ldm_patched.attention_pytorch


def test_forge_classic_is_named_and_an_unusable_gpu_said_once(ldm_patched, monkeypatch, log_records):
    from modules_forge import forge_version

    monkeypatch.setattr(forge_version, "version", "classic")
    assert entry.setup() == "reforge"
    lines = [r.message for r in log_records.records if r.levelno == logging.WARNING]
    assert lines == ["RDNA Flash Attention (Forge Classic): not active: CPU tensors (the kernels run on AMD "
                     "RDNA3/RDNA4 GPUs)"]
    assert ldm_patched.optimized_attention is ldm_patched.attention_pytorch  # nothing routed


def test_sd3s_four_dimensional_v_runs_on_the_kernels(ldm_patched, fake_gpu):
    # ldm_patched's MMDiT passes v as (B, L, H, D) beside (B, L, H*D) q and k.
    entry.setup()
    q, k, v = qkv(heads=4, dim=64, context=64)
    out = ldm_patched.optimized_attention(q, k, v.unflatten(-1, (4, 64)), 4)
    assert len(fake_gpu.launches) == 1 and ldm_patched.calls["optimized_attention"] == 0
    torch.testing.assert_close(out.float(), ldm_patched.attention_pytorch(q.float(), k.float(), v.float(), 4),
                               **KERNEL_TOL)


def test_cosmos_heads_first_call_with_heads_first_output_runs_on_the_kernels(ldm_patched, fake_gpu):
    # reForge's Cosmos v1 passes (B, H, L, D) and takes (B, H, L, D) back: skip_reshape, skip_output_reshape
    entry.setup()
    generator = torch.Generator().manual_seed(seeds.case_seed("cosmos skip_output_reshape"))
    q, k, v = (torch.randn(2, 4, 48, 64, generator=generator).half() for _ in range(3))
    out = ldm_patched.optimized_attention(q, k, v, 4, skip_reshape=True, mask=None, skip_output_reshape=True)
    assert len(fake_gpu.launches) == 1 and ldm_patched.calls["optimized_attention"] == 0
    reference = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert out.shape == (2, 4, 48, 64)
    torch.testing.assert_close(out.double(), reference, **KERNEL_TOL)


def test_a_call_form_the_routing_does_not_know_runs_the_hosts_function_and_is_logged_once(fake_gpu, log_records):
    seen = []

    def host_attention(q, k, v, heads, mask=None, **kwargs):
        seen.append(kwargs)
        return q

    routed = reforge.routed_attention_function(host_attention, fallback_name="the WebUI's own attention")
    q, k, v = qkv()
    for _ in range(2):
        assert routed(q, k, v, 8, transformer_options={"block": 1}) is q
    assert fake_gpu.launches == [] and seen == [{"transformer_options": {"block": 1}}] * 2
    (line,) = [r.message for r in log_records.records if "unknown to the extension" in r.message]
    assert line.endswith("not using the kernels: attention call with keyword transformer_options, unknown to the "
                         "extension (the WebUI's own attention runs these calls)")


def test_video_vae_blocks_that_took_vae_attention_route_and_come_back(ldm_patched, fake_gpu):
    from modules import script_callbacks

    model_module = importlib.import_module("ldm_patched.ldm.modules.diffusionmodules.model")
    wan_vae = importlib.import_module("ldm_patched.ldm.wan.vae")
    entry.setup()
    model = torch.nn.Sequential(wan_vae.AttentionBlock())
    script_callbacks.model_loaded_callback(model)
    generator = torch.Generator().manual_seed(seeds.case_seed("wan vae block"))
    frames = torch.randn(3, 3 * 64, 8, 8, generator=generator).half()  # q, k, v of 3 frames, one projection
    out = model[0](frames)
    assert len(fake_gpu.launches) == 1 and model_module.calls["vae_attention"] == 0
    q, k, v = (t.double().flatten(2).transpose(1, 2)[:, None] for t in frames.chunk(3, dim=1))
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v)[:, 0].transpose(1, 2).reshape(3, 64, 8, 8)
    torch.testing.assert_close(out.double(), reference, **KERNEL_TOL)
    script_callbacks.script_unloaded_callback()
    assert model[0].optimized_attention is model_module.pytorch_attention


# Folders of real reForge / Forge Classic checkouts (os.pathsep-separated, as the coverage tests take them);
# none in CI, where the fakes above stand for them
REAL_FOLDERS = [Path(p) for p in os.environ.get("RDNA_FA_TEST_WEBUIS", "").split(os.pathsep) if p]
REAL_LDM_PATCHED = [folder for folder in REAL_FOLDERS if (folder / "ldm_patched" / "ldm" / "wan" / "vae.py").is_file()]
BF16_TOL = dict(atol=3e-2, rtol=3e-2)  # the model's bf16 layers around the attention, against float64


@pytest.fixture(params=REAL_LDM_PATCHED, ids=str)
def real_ldm_patched(request):
    """A real reForge folder's own model code importable (its PyTorch attention chosen, on the CPU), as the
    coverage benchmark loads it; the extension's state and the host's modules go back afterwards."""
    webui = webui_harness.detect(request.param)
    webui_harness.start(webui, cpu=True)
    request.addfinalizer(lambda: take_off_path(webui.folder))
    return webui


def routed_against_float64(block: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the block's bf16 output with the extension's routing in place, as at a model load; the block's
    float64 output on the host's own attention)."""
    initialise(block, seed=seeds.case_seed(type(block).__name__))
    with torch.no_grad():
        reference = block.double()(x.double())
        reforge.rebinding.apply()
        reforge.route_vae_blocks(block)
        out = block.to(torch.bfloat16)(x.to(torch.bfloat16))
    return out, reference


@pytest.mark.skipif(not REAL_LDM_PATCHED, reason="no reForge folder with Wan's VAE in RDNA_FA_TEST_WEBUIS")
def test_real_cosmos_v1_attention_runs_on_the_kernels(real_ldm_patched, fake_gpu):
    blocks = importlib.import_module("ldm_patched.ldm.cosmos.blocks")
    operations = importlib.import_module("ldm_patched.modules.ops").disable_weight_init
    block = blocks.Attention(128, heads=2, dim_head=64, qkv_norm="RRI", operations=operations)
    x = torch.randn(32, 2, 128, generator=torch.Generator().manual_seed(seeds.case_seed("cosmos v1")))  # (S, B, K)
    out, reference = routed_against_float64(block, x)
    assert len(fake_gpu.launches) == 1
    torch.testing.assert_close(out.double(), reference, **BF16_TOL)


@pytest.mark.skipif(not REAL_LDM_PATCHED, reason="no reForge folder with Wan's VAE in RDNA_FA_TEST_WEBUIS")
@pytest.mark.parametrize("block_of", [
    lambda: importlib.import_module("ldm_patched.ldm.wan.vae").AttentionBlock(64),
    lambda: importlib.import_module("ldm_patched.ldm.cosmos.cosmos_tokenizer.layers3d").CausalAttnBlock(64, 32),
], ids=["wan", "cosmos"])
def test_real_video_vae_attention_blocks_run_on_the_kernels(real_ldm_patched, fake_gpu, block_of):
    block = block_of()
    x = torch.randn(1, 64, 2, 8, 8, generator=torch.Generator().manual_seed(seeds.case_seed("video vae")))
    out, reference = routed_against_float64(block, x)
    assert len(fake_gpu.launches) == 1 and tuple(fake_gpu.launches[0][0].shape) == (2, 1, 64, 64)  # 2 frames
    torch.testing.assert_close(out.double(), reference, **BF16_TOL)


def test_the_float32_setting_puts_a_float32_vae_on_the_kernels_in_bfloat16(ldm_patched, fake_gpu):
    from modules import script_callbacks

    model_module = importlib.import_module("ldm_patched.ldm.modules.diffusionmodules.model")
    entry.setup()
    model = torch.nn.Sequential(model_module.AttnBlock())
    script_callbacks.model_loaded_callback(model)
    generator = torch.Generator().manual_seed(seeds.case_seed("float32 vae"))
    q, k, v = (torch.randn(1, 64, 8, 8, generator=generator) for _ in range(3))  # --no-half-vae: float32
    model[0](q, k, v)
    assert fake_gpu.launches == [] and model_module.calls["vae_attention"] == 1  # off by default
    options.apply("rdna_fa_fp32_cast", True)
    out = model[0](q, k, v)
    assert len(fake_gpu.launches) == 1 and fake_gpu.launches[0][0].dtype == torch.bfloat16
    assert out.dtype == torch.float32 and model_module.calls["vae_attention"] == 1
    reference = model_module.pytorch_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(out.double(), reference, atol=2e-2, rtol=2e-2)  # bfloat16 inputs


def test_the_float32_setting_keeps_the_environments_cast(monkeypatch):
    monkeypatch.setattr(options, "_fp32_cast_from_env", "fp16")
    options.apply("rdna_fa_fp32_cast", True)
    assert rdna_flash_attn.settings.fp32_cast == "fp16" and options.current("rdna_fa_fp32_cast") is True
    options.apply("rdna_fa_fp32_cast", False)
    assert rdna_flash_attn.settings.fp32_cast == "off" and options.current("rdna_fa_fp32_cast") is False
