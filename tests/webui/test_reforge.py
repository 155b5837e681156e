"""reForge and Forge Classic through their call signatures (fakes of ldm_patched/): the attention
function the UNet looks up at call time and every module that bound it at import route to the kernels,
each loaded model's VAE blocks too, refused calls run the host's function with their own arguments,
and unloading puts everything back."""

from __future__ import annotations

import importlib
import logging
import sys

import pytest
import torch

from extension import entry, reforge

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
