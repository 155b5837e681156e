"""ComfyUI's own ModelAttentionBackend node (model/patch) beside the model node, in either order, on
ComfyUI's own code: a tree that has the node (0.33) runs these tests; older ones (0.3.75, which CI
installs) skip them, naming the tree."""

from __future__ import annotations

import logging

import pytest
import torch

from rdna_flash_attn.config import settings

from rdna_fa_lab.hosts.comfyui_harness import OPTIONLESS_MODELS, build, comfyui_version, sample

from .conftest import COMFYUI, TREE_VARIABLE

LATENT_TOLERANCE = dict(atol=2e-2, rtol=2e-2)  # float16 attention in float32 models (see test_model_node)


def _comfy_backend_node():
    try:
        from comfy_extras.nodes_model_advanced import ModelAttentionBackend
    except ImportError:
        return None
    return ModelAttentionBackend


@pytest.fixture(autouse=True)
def comfy_backend_node(comfyui):
    node = _comfy_backend_node()
    if node is None:
        pytest.skip(f"ComfyUI {comfyui_version(COMFYUI)} has no ModelAttentionBackend node (0.33 has: set "
                    f"{TREE_VARIABLE} to such a tree's folder)")
    settings.fp32_cast = "fp16"
    return node()


def pytorch_attention_spy(monkeypatch) -> list:
    """ComfyUI's registered PyTorch attention, which its node picks, recording its calls."""
    from comfy.ldm.modules import attention

    calls = []
    original = attention.REGISTERED_ATTENTION_FUNCTIONS["pytorch"]

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    monkeypatch.setitem(attention.REGISTERED_ATTENTION_FUNCTIONS, "pytorch", spy)
    return calls


def messages(log_records, level=logging.INFO) -> list[str]:
    return [r.getMessage() for r in log_records.records if r.levelno == level and "attention backend node" in r.getMessage()]


@pytest.mark.parametrize("name", ["sd15", "flux"])
def test_ours_after_comfys_node_runs_the_kernels_over_its_choice(name, comfy_backend_node, model_node, fake_gpu,
                                                                 monkeypatch, log_records):
    chosen_calls = pytorch_attention_spy(monkeypatch)
    model = build(name)
    (chosen,) = comfy_backend_node.patch(model, "pytorch attention")
    chosen_reference = sample(chosen, name)
    attention_calls = len(chosen_calls)
    assert attention_calls > 0 and fake_gpu.launches == []
    (routed,) = model_node.patch(chosen, True, True, "original backend")
    latent = sample(routed, name)
    torch.testing.assert_close(latent, chosen_reference, **LATENT_TOLERANCE)
    assert len(fake_gpu.launches) == attention_calls and len(chosen_calls) == attention_calls
    (line,) = messages(log_records)
    assert "placed after ComfyUI's attention backend node" in line and "ComfyUI's pytorch attention" in line


def test_calls_the_kernels_refuse_run_on_the_chosen_backend(comfy_backend_node, node_package, monkeypatch, fake_gpu):
    chosen_calls = pytorch_attention_spy(monkeypatch)
    model = build("sd15")
    (chosen,) = comfy_backend_node.patch(model, "pytorch attention")
    comfys_override = chosen.model_options["transformer_options"]["optimized_attention_override"]
    override = node_package.model_patch.make_override(node_package.routing.RoutingOptions(), comfys_override)
    q, k, v = (torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(s), dtype=torch.float16) for s in range(3))
    bool_mask = torch.ones(1, 16, 16, dtype=torch.bool)
    original_calls = []
    out = override(lambda *a, **kw: original_calls.append(a), q, k, v, 4, mask=bool_mask)
    assert out.shape == q.shape and len(chosen_calls) == 1 and original_calls == [] and fake_gpu.launches == []
    override(lambda *a, **kw: original_calls.append(a), q, k, v, 4)
    assert len(fake_gpu.launches) == 1 and len(chosen_calls) == 1 and original_calls == []


@pytest.mark.parametrize("name", ["sd15", *OPTIONLESS_MODELS])
def test_comfys_node_after_ours_decides_and_says_so_once(name, comfy_backend_node, model_node, fake_gpu, monkeypatch,
                                                        log_records):
    chosen_calls = pytorch_attention_spy(monkeypatch)
    model = build(name)
    (routed,) = model_node.patch(model, True, True, "original backend")
    (chosen,) = comfy_backend_node.patch(routed, "pytorch attention")
    sample(chosen, name)
    sample(chosen, name)
    assert fake_gpu.launches == []
    # the option-less models' calls bypass every override: ComfyUI's default attention runs them
    assert bool(chosen_calls) == (name not in OPTIONLESS_MODELS)
    (line,) = messages(log_records, logging.WARNING)
    assert "placed after this node, decides this model's attention" in line and "ComfyUI's pytorch attention" in line


def test_comfys_node_after_ours_keeps_comfys_memory_reservation(comfy_backend_node, model_node, fake_gpu, reserved):
    """Where ComfyUI's node decides the model's attention, ComfyUI's own estimate stands."""
    model = build("sd15")
    (routed,) = model_node.patch(model, True, True, "original backend")
    sample(routed, "sd15", steps=1)
    (chosen,) = comfy_backend_node.patch(routed, "pytorch attention")
    sample(chosen, "sd15", steps=1)
    sample(model, "sd15", steps=1)
    assert reserved[0] < reserved[1] == reserved[2]
