"""doctor's account of what ComfyUI 0.33 itself picks for attention on AMD GPUs (its
comfy/model_management.py start-up conditions), and the lines doctor prints from it."""

from __future__ import annotations

import pytest
import torch

from rdna_flash_attn.tools import comfyui_host

SUB_QUAD = "sub-quadratic attention (chunked, in PyTorch operations)"
SDPA = "PyTorch SDPA (AOTriton)"
PROBE_FAILED = "torch.backends.cuda.can_use_flash_attention says no for this GPU"

# (gfx target, torch, HIP, probe refusal) -> (model attention, words of the reason)
CASES = [
    (("gfx1100", "2.8.0+rocm6.4", "6.4.43482", None), (SDPA, "enables PyTorch attention on gfx1100")),
    (("gfx1151", "2.9.1+rocm7.1", "7.1.0", None), (SDPA, "enables PyTorch attention on gfx1151")),
    (("gfx1102", "2.9.1+rocm7.1", "7.1.0", None), (SUB_QUAD, "keeps gfx1102 on sub-quadratic attention")),
    (("gfx1103", "2.9.1+rocm7.1", "7.1.0", None), (SUB_QUAD, "keeps gfx1103 on sub-quadratic attention")),
    (("gfx1100", "2.6.0+rocm6.2", "6.2.41133", None), (SUB_QUAD, "only from PyTorch 2.7 on")),
    (("gfx1201", "2.8.0+rocm6.4", "6.4.43482", None), (SUB_QUAD, "only from ROCm 7.0 on")),
    (("gfx1201", "2.9.0+rocm7.0", "7.0.1", None), (SDPA, "enables PyTorch attention on gfx1201")),
    (("gfx1100", "2.9.0", "7.1.52802", PROBE_FAILED), (SUB_QUAD, "AOTriton probe fails")),
    (("gfx1200", "2.9.0", "7.1.52802", PROBE_FAILED), (SUB_QUAD, "silently leaves gfx1200 on sub-quadratic")),
]


@pytest.mark.parametrize("arguments, expected", CASES)
def test_what_comfyui_picks_on_rocm(arguments, expected):
    choice = comfyui_host.comfy_attention("rocm", *arguments)
    model, reason = expected
    assert choice.model == model and reason in choice.why
    assert choice.memory_efficient_reservation == (model == SDPA)
    assert "split attention" in choice.vae, "the VAE never gets PyTorch attention on AMD"


def test_zluda_is_taken_for_nvidia():
    choice = comfyui_host.comfy_attention("zluda", "gfx1100", "2.7.1+cu118", None, None)
    assert "math backend" in choice.model and "math backend" in choice.vae and choice.memory_efficient_reservation


def test_report_says_what_happens_without_and_with_the_nodes():
    lines = dict(comfyui_host.report_lines(comfyui_host.comfy_attention("rocm", "gfx1102", "2.9.1", "7.1", None)))
    assert lines["  model calls"].startswith(f"without the node: {SUB_QUAD}; with the model node: the kernels")
    assert "with the VAE node: the kernels" in lines["  VAE calls"]
    assert "holding the score matrix" in lines["  sampling memory"]


def test_the_probe_reports_why_it_fails(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)
    assert comfyui_host.aotriton_probe_refusal(torch.device("cpu")) == "this PyTorch was built without flash attention"
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    monkeypatch.setattr(torch.backends.cuda, "can_use_flash_attention", lambda params, debug: False)
    assert comfyui_host.aotriton_probe_refusal(torch.device("cpu")) == PROBE_FAILED

    def raising(params, debug):
        raise RuntimeError("HIP error: invalid device function")

    monkeypatch.setattr(torch.backends.cuda, "can_use_flash_attention", raising)
    assert comfyui_host.aotriton_probe_refusal(torch.device("cpu")) == (
        "the probe raised RuntimeError: HIP error: invalid device function")


@pytest.mark.parametrize("version, expected", [("2.8.0+rocm6.4", (2, 8)), ("7.1.52802-abc", (7, 1)), (None, (0, 0)),
                                               ("weird", (0, 0))])
def test_version_tuple(version, expected):
    assert comfyui_host.version_tuple(version) == expected
