"""A1111 integration through its call signatures (fakes of modules/): registration through
on_list_optimizers, settings registration and onchange, apply/undo through A1111's selection, and an
unusable GPU or artifact making the optimization unavailable instead of failing the start."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

import rdna_flash_attn
from extension import a1111, entry, options
from rdna_flash_attn.runtime import artifacts

pytest.importorskip("ldm.modules.attention", reason="stable-diffusion-sdkit (ldm) not installed")


@pytest.fixture
def started(webui):
    """A1111 with the extension set up, as the scripts shim does at start (which already asks about
    the device: tests request fake_gpu before this)."""
    shared = webui("a1111")
    assert entry.setup() == "a1111"
    return shared


def listed(title):
    from modules import sd_hijack

    sd_hijack.list_optimizers()
    return [x for x in sd_hijack.optimizers if x.title() == title]


def test_registered_through_on_list_optimizers_and_first_where_available(fake_gpu, started):
    from modules import sd_hijack, sd_hijack_optimizations

    (optimization,) = listed("RDNA Flash Attention")
    assert isinstance(optimization, sd_hijack_optimizations.SdOptimization)
    assert sd_hijack.optimizers[0] is optimization  # "Automatic" picks it
    assert optimization.unavailable_reason is None


def test_not_listed_without_a_supported_gpu_and_said_once(log_records, started):
    assert listed("RDNA Flash Attention") == []
    listed("RDNA Flash Attention")
    records = log_records.get_records("setup") + log_records.records  # setup: the shim's start
    lines = [r for r in records if r.levelno == logging.WARNING and "RDNA Flash Attention" in r.message]
    assert [r.message for r in lines] == [
        "RDNA Flash Attention (A1111): not active: CPU tensors (the kernels run on AMD RDNA3/RDNA4 GPUs)"
    ]


def test_apply_and_undo_through_a1111_selection(fake_gpu, started):
    import ldm.modules.attention
    import ldm.modules.diffusionmodules.model
    from modules import sd_hijack
    from modules.hypernetworks import hypernetwork

    classes = (ldm.modules.attention.CrossAttention, ldm.modules.diffusionmodules.model.AttnBlock)
    # What A1111's undo installs: its einsum CrossAttention forward, ldm's own AttnBlock forward.
    unoptimized = [hypernetwork.attention_CrossAttention_forward, classes[1].forward]
    listed("RDNA Flash Attention")
    assert sd_hijack.apply_optimizations("RDNA Flash Attention") == "RDNA Flash Attention"
    assert all(cls.forward is not forward for cls, forward in zip(classes, unoptimized))
    torch.manual_seed(0)
    module = ldm.modules.attention.CrossAttention(64, heads=2, dim_head=32).half()
    with torch.no_grad():
        module(torch.randn(1, 8, 64).half())
    assert len(fake_gpu.launches) == 1
    assert sd_hijack.apply_optimizations("sdp - scaled dot product") == "sdp"  # switching away undoes it
    assert sd_hijack.apply_optimizations("None") == ""
    assert all(cls.forward is forward for cls, forward in zip(classes, unoptimized))


def test_settings_registered_in_their_own_section_and_applied_on_change(fake_gpu, started):
    from modules import script_callbacks, shared

    listed("RDNA Flash Attention")
    script_callbacks.ui_settings_callback()
    infos = {key: shared.opts.data_labels[key] for key in options.BY_KEY}
    assert {info.section for info in infos.values()} == {("rdna_flash_attn", "RDNA Flash Attention")}
    assert all(info.default is options.BY_KEY[key].default for key, info in infos.items())
    gradio = pytest.importorskip("gradio")
    assert all(info.component is gradio.Checkbox for info in infos.values())
    assert "kernels available" in infos["rdna_fa_unet"].comment_after

    assert shared.opts.set("rdna_fa_training", False)
    assert rdna_flash_attn.settings.training is False
    assert shared.opts.set("rdna_fa_8bit", True)
    assert rdna_flash_attn.settings.precision == "8bit-qkpv"
    assert shared.opts.set("rdna_fa_8bit", False)
    assert rdna_flash_attn.settings.precision == "exact"
    assert shared.opts.set("rdna_fa_fp32_cast", True)
    assert rdna_flash_attn.settings.fp32_cast == "bf16"
    assert shared.opts.set("rdna_fa_fp32_cast", False)
    assert rdna_flash_attn.settings.fp32_cast == "off"
    assert shared.opts.set("rdna_fa_log_fallbacks", True)
    assert rdna_flash_attn.settings.log_level == "INFO"
    assert shared.opts.set("rdna_fa_unet", False) and shared.opts.set("rdna_fa_vae", False)
    assert (options.toggles.unet, options.toggles.vae) == (False, False)
    assert shared.opts.set("rdna_fa_log_fallbacks", False)
    assert rdna_flash_attn.settings.log_level is None


def test_saved_settings_apply_at_start(webui):
    shared = webui("a1111")
    shared.opts.data["rdna_fa_training"] = False  # as loaded from config.json before scripts run
    shared.opts.data["rdna_fa_vae"] = False
    entry.setup()
    assert rdna_flash_attn.settings.training is False and options.toggles.vae is False


@pytest.mark.parametrize("table", ["targets", "targets_cov4"])  # code object v5, and the v4 beside it
def test_a_broken_code_object_makes_it_unavailable(fake_gpu, started, tmp_path, monkeypatch, table):
    broken = tmp_path / "prebuilt"
    shutil.copytree(artifacts.prebuilt_dir(), broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    code_object = broken / manifest[table]["gfx1100"]["file"]
    code_object.write_bytes(code_object.read_bytes() + b"damage")
    monkeypatch.setattr(artifacts, "prebuilt_dir", lambda: broken)

    assert listed("RDNA Flash Attention") == []
    from modules import sd_hijack_optimizations

    optimization = a1111.optimization_class(sd_hijack_optimizations.SdOptimization)()
    assert optimization.is_available() is False
    assert "does not match the sha256" in optimization.unavailable_reason


def test_a_missing_manifest_makes_it_unavailable(fake_gpu, started, tmp_path, monkeypatch):
    monkeypatch.setattr(artifacts, "prebuilt_dir", lambda: tmp_path)
    assert listed("RDNA Flash Attention") == []
    from modules import script_callbacks, shared

    script_callbacks.ui_settings_callback()  # the settings still register, saying why
    assert "not active: no kernel manifest" in shared.opts.data_labels["rdna_fa_unet"].comment_after


def test_rdna_fa_disable_makes_it_unavailable(fake_gpu, started):
    rdna_flash_attn.settings.disable = True
    assert listed("RDNA Flash Attention") == []


def test_sd3_attention_runs_on_the_kernels_while_applied(fake_gpu, started):
    from modules import sd_hijack
    from modules.models.sd3 import mmdit, other_impls

    q, k, v = (torch.randn(2, 40, 4 * 64, generator=torch.Generator().manual_seed(s)).half() for s in range(3))
    expected = other_impls.attention(q.float(), k.float(), v.float(), 4)
    listed("RDNA Flash Attention")
    sd_hijack.apply_optimizations("RDNA Flash Attention")
    calls = other_impls.calls["attention"]
    out = mmdit.block_mixing(q, k, v, 4)
    torch.testing.assert_close(out.float(), expected, atol=2e-3, rtol=2e-3)
    assert len(fake_gpu.launches) == 1 and other_impls.calls["attention"] == calls
    sd_hijack.apply_optimizations("None")
    assert mmdit.attention is other_impls.attention


def test_a_selected_but_unavailable_optimization_is_said_after_the_model_load(started, log_records):
    from modules import script_callbacks, sd_hijack

    started.opts.set("cross_attention_optimization", "RDNA Flash Attention")
    listed("RDNA Flash Attention")  # not listed: the CPU cannot run the kernels
    assert sd_hijack.apply_optimizations() == "sdp"  # A1111 silently takes its first available one
    script_callbacks.model_loaded_callback(object())
    script_callbacks.model_loaded_callback(object())
    notes = [r.message for r in log_records.records if "A1111 applied" in r.message]
    assert notes == ["RDNA Flash Attention is selected in Settings > Optimizations but cannot run here (CPU tensors "
                     "(the kernels run on AMD RDNA3/RDNA4 GPUs)); A1111 applied 'sdp' instead"]


def test_automatic_with_an_optimization_flag_is_said_after_the_model_load(fake_gpu, started, log_records,
                                                                          monkeypatch):
    from modules import script_callbacks, sd_hijack

    monkeypatch.setattr(started.cmd_opts, "opt_sdp_attention", True, raising=False)
    listed("RDNA Flash Attention")
    assert sd_hijack.apply_optimizations() == "sdp"
    script_callbacks.model_loaded_callback(object())
    (note,) = [r.message for r in log_records.records if "because of --opt-sdp-attention" in r.message]
    assert "choose 'RDNA Flash Attention' in Settings > Optimizations" in note
    monkeypatch.setattr(started.cmd_opts, "opt_sdp_attention", False)
    assert sd_hijack.apply_optimizations() == "RDNA Flash Attention"
    script_callbacks.model_loaded_callback(object())
    assert len([r for r in log_records.records if "applied 'sdp'" in r.message]) == 1
