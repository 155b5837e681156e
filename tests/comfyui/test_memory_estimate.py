"""What ComfyUI reserves for a routed model's activations before sampling (memory_required, handed to
load_models_gpu): the memory-efficient figure where the kernels take the calls, ComfyUI's own otherwise."""

from __future__ import annotations

import pytest

from rdna_flash_attn.config import settings

from rdna_fa_lab.hosts.comfyui_harness import build, sample


@pytest.fixture(autouse=True)
def float16_attention():
    settings.fp32_cast = "fp16"


def comfys_efficient_estimate(model, shape, monkeypatch) -> float:
    """ComfyUI's own memory_required for `shape` as it computes it with xformers (its memory-efficient branch)."""
    from comfy import model_management

    with monkeypatch.context() as patch:
        patch.setattr(model_management, "xformers_enabled", lambda: True)
        return model.model.memory_required(list(shape))


def cfg_latent_shape(name, size=16, frames=2) -> tuple:
    """The CFG batch's latent shape the harness samples (batch 2)."""
    return (2, 4, size, size) if name == "sd15" else (2, 16, frames, size, size)


@pytest.mark.parametrize("name", ["sd15", "wan"])
def test_a_routed_model_is_reserved_as_memory_efficient(name, model_node, fake_gpu, reserved, monkeypatch):
    model = build(name)
    sample(model, name, steps=1)
    unrouted = reserved[0]
    assert unrouted == model.model.memory_required(list(cfg_latent_shape(name))), "ComfyUI's own estimate"
    (routed,) = model_node.patch(model, True, True, "original backend")
    sample(routed, name, steps=1)
    efficient = comfys_efficient_estimate(model, cfg_latent_shape(name), monkeypatch)
    assert reserved[1] == efficient < unrouted
    sample(model, name, steps=1)  # the model without the node: ComfyUI's estimate again
    assert reserved[2] == unrouted


def test_without_a_usable_gpu_the_estimate_is_comfys(model_node, reserved):
    model = build("wan")
    sample(model, "wan", steps=1)
    (routed,) = model_node.patch(model, True, True, "original backend")
    sample(routed, "wan", steps=1)
    assert reserved[0] == reserved[1]


def test_a_disabled_node_drops_the_wrapper(model_node, fake_gpu, reserved):
    model = build("wan")
    sample(model, "wan", steps=1)
    (routed,) = model_node.patch(model, True, True, "original backend")
    (disabled,) = model_node.patch(routed, False, True, "original backend")
    sample(disabled, "wan", steps=1)
    assert reserved[0] == reserved[1]


def test_the_global_switch_reserves_as_memory_efficient(node_package, fake_gpu, reserved, monkeypatch):
    unrouted = build("wan")
    sample(unrouted, "wan", steps=1)
    assert node_package.enable_global()
    routed = build("wan")  # made while the switch is on
    sample(routed, "wan", steps=1)
    node_package.disable_global()
    sample(routed, "wan", steps=1)  # its wrapper stays, and passes through once the switch is off
    efficient = comfys_efficient_estimate(routed, cfg_latent_shape("wan"), monkeypatch)
    assert reserved == [reserved[0], efficient, reserved[0]] and efficient < reserved[0]
