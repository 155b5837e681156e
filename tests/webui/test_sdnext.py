"""SD.Next: the extension turns the dispatcher's guarded SDPA override on where the kernels are
available, and the UNet setting switches it at once."""

from __future__ import annotations

import functools

import pytest
import torch

import rdna_flash_attn
from extension import entry
from extension import sdnext as sdnext_adapter

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


class SdNextSdpa:
    """SD.Next's SDPA handling (modules/devices.py), as the extension meets it: `set_sdpa_params()`
    puts back the SDPA saved at its first call and stacks SD.Next's own wrapper on it (here its
    dynamic, sliced attention, which hands every call on); it runs at start-up, before extensions load,
    and again at every model load. Counts the calls its wrapper sees."""

    def __init__(self, devices):
        self.devices = devices
        self.wrapper_calls = 0
        devices.sdpa_original = None
        devices.set_sdpa_params = self.set_sdpa_params

    def set_sdpa_params(self):
        if self.devices.sdpa_original is not None:
            torch.nn.functional.scaled_dot_product_attention = self.devices.sdpa_original
        else:
            self.devices.sdpa_original = torch.nn.functional.scaled_dot_product_attention
        below = torch.nn.functional.scaled_dot_product_attention

        @functools.wraps(below)
        def dynamic_scaled_dot_product_attention(*args, **kwargs):
            self.wrapper_calls += 1
            return below(*args, **kwargs)

        torch.nn.functional.scaled_dot_product_attention = self.installed = dynamic_scaled_dot_product_attention


@pytest.fixture
def sdnext_sdpa(sdnext, monkeypatch):
    from modules import devices, script_callbacks

    original = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", original)  # put back afterwards
    before_process = []
    monkeypatch.setattr(script_callbacks, "on_before_process", lambda f, *, name=None: before_process.append(f),
                        raising=False)
    fake = SdNextSdpa(devices)
    fake.before_process = before_process
    devices.set_sdpa_params()  # SD.Next's start-up, before the extension loads
    return fake


def test_the_override_survives_every_model_load(sdnext_sdpa, fake_gpu):
    from modules import devices, script_callbacks

    assert entry.setup() == "sdnext" and rdna_flash_attn.sdpa_patch_enabled()
    for _ in range(2):
        devices.set_sdpa_params()  # a model load, VAE change or Control run
        script_callbacks.model_loaded_callback(object())
        assert rdna_flash_attn.sdpa_patch_enabled()
    q = torch.randn(1, 2, 16, 64).half()
    torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert len(fake_gpu.launches) == 1 and sdnext_sdpa.wrapper_calls == 0
    mask = torch.zeros(16, 16, dtype=torch.half)
    torch.nn.functional.scaled_dot_product_attention(q.float(), q.float(), q.float(), attn_mask=mask.float())
    assert sdnext_sdpa.wrapper_calls == 1  # refused calls run on SD.Next's own attention, its newest wrapper


def test_a_reset_that_bypasses_the_hook_is_undone_before_the_next_job(sdnext_sdpa, fake_gpu):
    from modules import devices

    assert entry.setup() == "sdnext"
    devices.set_sdpa_params.rdna_original()  # a caller that bound SD.Next's function before the hook
    assert not rdna_flash_attn.sdpa_patch_enabled()
    (before_process,) = sdnext_sdpa.before_process
    before_process(object())
    assert rdna_flash_attn.sdpa_patch_enabled()


def test_the_settings_status_says_what_is_installed(sdnext_sdpa, fake_gpu):
    from modules import devices, script_callbacks

    assert entry.setup() == "sdnext"
    script_callbacks.ui_settings_callback()
    assert sdnext_adapter.status_text(None) == "kernels available; torch's scaled_dot_product_attention is routed through them"
    devices.set_sdpa_params.rdna_original()
    assert "another function has replaced torch's scaled_dot_product_attention" in sdnext_adapter.status_text(None)


def test_unloading_puts_sdnext_back(sdnext_sdpa, fake_gpu):
    from modules import devices, script_callbacks

    assert entry.setup() == "sdnext"
    script_callbacks.script_unloaded_callback()
    assert devices.set_sdpa_params == sdnext_sdpa.set_sdpa_params and not rdna_flash_attn.sdpa_patch_enabled()
    assert torch.nn.functional.scaled_dot_product_attention is sdnext_sdpa.installed
