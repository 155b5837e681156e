"""Forge integration through its call signatures (fakes of backend/): every module that imported
attention_function / attention_function_single_head_spatial is rebound and restored on unload,
results equal Forge's own functions, refused calls go to them, and the memory estimate is unchanged."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

import rdna_flash_attn
from extension import entry, forge, options

KERNEL_TOL = dict(atol=2e-3, rtol=1e-2)  # fp16 kernels (float32 math) vs Forge's SDPA on fp16 inputs


@pytest.fixture
def backend(webui):
    """Forge with its model modules loaded; returns backend.attention."""
    webui("forge")
    for name in ("backend.nn.unet", "backend.nn.vae", "backend.modules.k_model"):
        importlib.import_module(name)
    return importlib.import_module("backend.attention")


def reference_attention(q, k, v, heads, mask=None):
    """Forge's attention_pytorch in float32."""
    b, _, inner = q.shape
    q, k, v = (t.float().view(b, -1, heads, inner // heads).transpose(1, 2) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).reshape(b, -1, inner)


def test_setup_rebinds_forge_and_its_importers_and_keeps_the_memory_estimate(backend, fake_gpu):
    unet, vae, k_model = (sys.modules[f"backend.{name}"] for name in ("nn.unet", "nn.vae", "modules.k_model"))
    model = k_model.KModel(torch.float16)
    estimate = model.memory_required((2, 4, 128, 128))
    assert entry.setup() == "forge"
    assert unet.attention_function.rdna_original is backend.attention_pytorch
    assert vae.attention_function_single_head_spatial.rdna_original is backend.pytorch_attention_single_head_spatial
    assert backend.attention_function.rdna_original is backend.attention_pytorch
    # estimated as with Forge's own PyTorch attention, not as for an unknown function (1.65 x, float32)
    assert model.memory_required((2, 4, 128, 128)) == estimate
    assert backend.attention_function.rdna_original is backend.attention_pytorch  # ours back after it


def test_builtin_extensions_looking_the_function_up_in_forge_run_on_the_kernels(backend, fake_gpu):
    # IP-Adapter, SAG, reference-only and StyleAlign call backend.attention.attention_function at call time
    entry.setup()
    q, k, v = torch.randn(2, 64, 320).half(), torch.randn(2, 77, 320).half(), torch.randn(2, 77, 320).half()
    out = backend.attention_function(q, k, v, heads=8)
    assert len(fake_gpu.launches) == 1 and backend.calls["attention_function"] == 0
    torch.testing.assert_close(out.float(), reference_attention(q, k, v, 8), **KERNEL_TOL)


def test_unet_attention_runs_on_the_kernels_and_matches_forge(backend, fake_gpu):
    entry.setup()
    unet = sys.modules["backend.nn.unet"]
    q, k, v = torch.randn(2, 64, 320).half(), torch.randn(2, 77, 320).half(), torch.randn(2, 77, 320).half()
    out = unet.cross_attention(q, k, v, 8)
    assert len(fake_gpu.launches) == 1 and backend.calls["attention_function"] == 0
    assert out.shape == (2, 64, 320) and out.dtype == torch.float16
    torch.testing.assert_close(out.float(), reference_attention(q, k, v, 8), **KERNEL_TOL)


def test_skip_reshape_layout_as_flux_calls_it(backend, fake_gpu):
    entry.setup()
    flux = importlib.import_module("backend.nn.flux")  # a model type first loaded after the start
    assert flux.attention_function is backend.attention_function  # imported from Forge's module: ours
    from modules import script_callbacks

    script_callbacks.model_loaded_callback(object())
    q, k, v = (torch.randn(1, 4, 32, 128).half() for _ in range(3))
    out = flux.attention(q, k, v)
    assert len(fake_gpu.launches) == 1
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
    torch.testing.assert_close(out.float(), expected.transpose(1, 2).reshape(1, 32, 512), **KERNEL_TOL)


def test_vae_single_head_spatial_matches_forge(backend, fake_gpu):
    entry.setup()
    vae = sys.modules["backend.nn.vae"]
    q, k, v = (torch.randn(1, 64, 6, 5).half() for _ in range(3))
    out = vae.attn_block(q, k, v)
    assert len(fake_gpu.launches) == 1 and tuple(fake_gpu.launches[0][0].shape) == (1, 1, 30, 64)
    expected = backend.pytorch_attention_single_head_spatial(q.float(), k.float(), v.float())
    torch.testing.assert_close(out.float(), expected, **KERNEL_TOL)


def test_masks_toggles_and_unsupported_calls_go_to_forge(backend, fake_gpu):
    entry.setup()
    unet, vae = sys.modules["backend.nn.unet"], sys.modules["backend.nn.vae"]
    q, k, v = torch.randn(1, 16, 320).half(), torch.randn(1, 77, 320).half(), torch.randn(1, 77, 320).half()
    mask = torch.zeros(1, 16, 77, dtype=torch.float16)  # 3-D: Forge's PyTorch backend reads it heads first
    mask[..., 40:] = float("-inf")
    out = unet.cross_attention(q, k, v, 8, mask)
    torch.testing.assert_close(out.float(), reference_attention(q, k, v, 8, mask.float()), **KERNEL_TOL)
    unet.cross_attention(q, k, v, 16)  # head dim 20: refused by the kernels
    options.apply("rdna_fa_unet", False)
    unet.cross_attention(q, k, v, 8)
    options.apply("rdna_fa_vae", False)
    vae.attn_block(*(torch.randn(1, 64, 2, 2).half() for _ in range(3)))
    assert not fake_gpu.launches
    # 4: the 3-D mask's call, the probe of how Forge's function reads such masks before it, and two more
    assert backend.calls == {"attention_function": 4, "single_head_spatial": 1}
    assert "head dim" in next(iter(rdna_flash_attn.stats()["fallback_reasons"]))


def test_float_masks_every_backend_reads_alike_run_on_the_kernels(backend, fake_gpu):
    """4-D and 2-D additive masks mean the same to each of Forge's backends and to SDPA; 3-D ones
    (heads first in its PyTorch backend, batch first in the others) and bool ones (key padding in some)
    stay with Forge."""
    entry.setup()
    unet = sys.modules["backend.nn.unet"]
    generator = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, n, 320, generator=generator).half() for n in (16, 77, 77))
    padding = torch.zeros(2, 1, 1, 77, dtype=torch.float16)
    padding[0, ..., 50:] = float("-inf")
    bias = torch.randn(16, 77, generator=generator).half()
    for mask in (padding, bias):
        out = unet.cross_attention(q, k, v, 5, mask)  # head dim 64
        torch.testing.assert_close(out.float(), reference_attention(q, k, v, 5, mask.float()), **KERNEL_TOL)
    assert len(fake_gpu.launches) == 2 and backend.calls["attention_function"] == 0
    unet.cross_attention(q, k, v, 5, bias[None])
    unet.cross_attention(q, k, v, 5, padding == 0)
    # 3: the two calls, and before the 3-D one the probe of how Forge's function reads such masks
    assert len(fake_gpu.launches) == 2 and backend.calls["attention_function"] == 3


def test_a_failure_in_our_code_is_logged_once_and_forge_runs_the_call(backend, fake_gpu, monkeypatch, log_records):
    def broken(*args, **kwargs):
        raise RuntimeError("wrapper broke")

    entry.setup()
    monkeypatch.setattr(rdna_flash_attn, "attention_or_reason", broken)
    unet, vae = sys.modules["backend.nn.unet"], sys.modules["backend.nn.vae"]
    q, k, v = torch.randn(1, 16, 320).half(), torch.randn(1, 77, 320).half(), torch.randn(1, 77, 320).half()
    out = [unet.cross_attention(q, k, v, 8) for _ in range(2)]
    vae.attn_block(*(torch.randn(1, 64, 2, 2).half() for _ in range(3)))
    torch.testing.assert_close(out[0].float(), reference_attention(q, k, v, 8), **KERNEL_TOL)
    assert backend.calls == {"attention_function": 2, "single_head_spatial": 1}
    warnings = [r.message for r in log_records.records if "wrapper broke" in r.message]
    assert len(warnings) == 2


def test_unload_restores_every_module(backend, fake_gpu):
    from modules import script_callbacks

    entry.setup()
    flux = importlib.import_module("backend.nn.flux")
    script_callbacks.model_loaded_callback(object())
    script_callbacks.script_unloaded_callback()
    assert sys.modules["backend.nn.unet"].attention_function is backend.attention_pytorch
    assert flux.attention_function is backend.attention_pytorch
    assert sys.modules["backend.nn.vae"].attention_function_single_head_spatial is backend.pytorch_attention_single_head_spatial
    assert backend.attention_function is backend.attention_pytorch
    assert not hasattr(sys.modules["backend.modules.k_model"].KModel.memory_required, "rdna_original")
    assert forge.rebinding.bound == []


def test_nothing_rebound_without_a_supported_gpu(backend, log_records):
    assert entry.setup() == "forge"
    assert sys.modules["backend.nn.unet"].attention_function is backend.attention_pytorch
    assert [r.message for r in log_records.records if "RDNA Flash Attention" in r.message] == [
        "RDNA Flash Attention (Forge): not active: CPU tensors (the kernels run on AMD RDNA3/RDNA4 GPUs)"
    ]


def test_sd35_attention_runs_on_the_kernels_from_the_model_load_that_imports_it(backend, fake_gpu):
    from modules import script_callbacks

    entry.setup()
    mmditx = importlib.import_module("backend.nn.mmditx")  # imported with the first SD3.5 model
    script_callbacks.model_loaded_callback(object())
    q, k, v = (torch.randn(2, 40, 4 * 64, generator=torch.Generator().manual_seed(s)).half() for s in range(3))
    out = mmditx.block_mixing(q, k, v, 4)
    assert len(fake_gpu.launches) == 1 and mmditx.calls["attention"] == 0
    torch.testing.assert_close(out.float(), reference_attention(q, k, v, 4), **KERNEL_TOL)
    mmditx.block_mixing(q, k, v, 4)
    mask = torch.zeros(40, 40)
    mmditx.attention(q.float(), k.float(), v.float(), 4, mask)  # refused (mask): Forge's function runs it
    assert mmditx.calls["attention"] == 1
    script_callbacks.script_unloaded_callback()
    assert mmditx.attention.__name__ == "attention" and not hasattr(mmditx.attention, "rdna_original")
