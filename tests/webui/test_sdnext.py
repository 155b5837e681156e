"""SD.Next: the extension turns the dispatcher's guarded SDPA override on where the kernels are
available, and the UNet setting switches it at once."""

from __future__ import annotations

import pytest
import torch

import rdna_flash_attn
from extension import entry

SDNEXT_URL = "https://github.com/vladmandic/sdnext"


@pytest.fixture
def sdnext(webui, monkeypatch):
    shared = webui("a1111")  # SD.Next keeps A1111's modules.shared / script_callbacks API
    monkeypatch.setattr(shared, "url", SDNEXT_URL, raising=False)
    return shared


def test_sdpa_override_follows_the_unet_setting(sdnext, fake_gpu):
    from modules import script_callbacks

    assert entry.setup() == "sdnext"
    assert rdna_flash_attn.sdpa_patch_enabled()
    q = torch.randn(1, 2, 16, 64).half()
    torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert len(fake_gpu.launches) == 1
    script_callbacks.ui_settings_callback()
    sdnext.opts.set("rdna_fa_unet", False)
    assert not rdna_flash_attn.sdpa_patch_enabled()
    sdnext.opts.set("rdna_fa_unet", True)
    assert rdna_flash_attn.sdpa_patch_enabled()
    script_callbacks.script_unloaded_callback()
    assert not rdna_flash_attn.sdpa_patch_enabled()


def test_no_override_without_a_supported_gpu(sdnext):
    assert entry.setup() == "sdnext"
    assert not rdna_flash_attn.sdpa_patch_enabled()
