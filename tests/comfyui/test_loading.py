"""Loading this repository as a ComfyUI custom node: through ComfyUI's own loader, under the folder
names users give it, with the core package imported exactly once under its own name."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rdna_fa_lab.hosts.comfyui_harness import REPO_ROOT
from .conftest import COMFYUI, load_custom_node

CORE_FILE = REPO_ROOT / "rdna_flash_attn" / "__init__.py"
HARNESS = REPO_ROOT / "rdna_fa_lab" / "hosts" / "comfyui_harness.py"
DISPATCH_FILE = REPO_ROOT / "rdna_flash_attn" / "dispatch" / "router.py"

CHECK_CORE = f"""
import sys, torch
core = sys.modules["rdna_flash_attn"]
assert core.__file__ == {str(CORE_FILE)!r}, core.__file__
copies = [m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == {str(DISPATCH_FILE)!r}]
assert len(copies) == 1, [m.__name__ for m in copies]
assert hasattr(torch.ops.rdna_flash_attn, "fwd")
"""

# Before 2024 ComfyUI registered a custom node under its bare folder name (sys.modules[folder]);
# this mirrors that, for the folder name that collides with the core package.
OLD_STYLE_LOADER = """
import importlib.util, os, sys
def old_style_load(path):
    name = os.path.basename(path)
    spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
"""


def environment_without_repository_paths() -> dict:
    """This process's environment less the PYTHONPATH entries in this repository: the child imports the core only
    as the loader under test does, while a newer ComfyUI's dependencies named there stay importable."""
    kept = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if entry and not Path(entry).resolve().is_relative_to(REPO_ROOT)]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(kept))


def run_python(*parts: str, cwd) -> str:
    code = "\n".join(textwrap.dedent(part) for part in parts)
    result = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                            timeout=300, env=environment_without_repository_paths())
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.fixture
def custom_nodes(tmp_path):
    """A custom_nodes folder holding this repository under both names users give it."""
    folder = tmp_path / "custom_nodes"
    folder.mkdir()
    for name in ("rdna_flash_attn", "ComfyUI-RDNA-Flash-Attention"):
        (folder / name).symlink_to(REPO_ROOT, target_is_directory=True)
    return folder


def test_comfyuis_loader_under_both_folder_names(custom_nodes):
    out = run_python(f"""
        import asyncio, importlib.util, inspect, sys
        # The harness by its path: the core must not be imported before ComfyUI's loader imports it.
        spec = importlib.util.spec_from_file_location("harness", {str(HARNESS)!r})
        harness = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(harness)
        harness.start_comfyui(__import__("pathlib").Path({str(COMFYUI)!r}))
        import nodes
        for name in ("rdna_flash_attn", "ComfyUI-RDNA-Flash-Attention"):
            loaded = nodes.load_custom_node({str(custom_nodes)!r} + "/" + name)
            assert (asyncio.run(loaded) if inspect.iscoroutine(loaded) else loaded) is True, name
        assert nodes.NODE_CLASS_MAPPINGS["RDNAFlashAttentionModel"].RETURN_TYPES == ("MODEL",)
        assert nodes.NODE_DISPLAY_NAME_MAPPINGS["RDNAFlashAttentionVAE"] == "RDNA Flash Attention (VAE)"
    """, CHECK_CORE, 'print("loaded")', cwd=custom_nodes.parent)
    assert out.strip() == "loaded"


def test_old_loader_naming_the_module_after_the_core_reuses_the_imported_core(custom_nodes):
    out = run_python(f"""
        import sys
        sys.path.insert(0, {str(REPO_ROOT)!r})
        import torch, rdna_flash_attn                 # another node imported the core first, torch before it
        dispatch = sys.modules["rdna_flash_attn.dispatch"]
        sys.path.remove({str(REPO_ROOT)!r})
    """, OLD_STYLE_LOADER, f"""
        module = old_style_load({str(custom_nodes / "rdna_flash_attn")!r})
        assert sorted(module.NODE_CLASS_MAPPINGS) == ["RDNAFlashAttentionModel", "RDNAFlashAttentionVAE"]
        assert sys.modules["rdna_flash_attn.dispatch"] is dispatch
        assert sys.modules["rdna_flash_attn"].dispatch is dispatch
        assert sys.modules["rdna_flash_attn.nodes.routing"].core_or_reason() is sys.modules["rdna_flash_attn"]
    """, CHECK_CORE, 'print("reused")', cwd=custom_nodes.parent)
    assert out.strip() == "reused"


def test_old_loader_first_import_with_custom_nodes_on_sys_path(custom_nodes):
    """Nothing imported the core yet, and `import rdna_flash_attn` would find the repository root
    itself: the core still comes from the repository's own rdna_flash_attn/ folder."""
    out = run_python(f"""
        import sys
        sys.path.insert(0, {str(custom_nodes)!r})
    """, OLD_STYLE_LOADER, f"""
        module = old_style_load({str(custom_nodes / "rdna_flash_attn")!r})
        assert "RDNAFlashAttentionModel" in module.NODE_CLASS_MAPPINGS
    """, CHECK_CORE, f"""
        # a second copy of the core under another module name registers its own custom ops
        import importlib.util
        spec = importlib.util.spec_from_file_location("second_copy", {str(CORE_FILE)!r},
                                                      submodule_search_locations=[{str(CORE_FILE.parent)!r}])
        second = importlib.util.module_from_spec(spec)
        sys.modules["second_copy"] = second
        spec.loader.exec_module(second)
        assert hasattr(torch.ops.rdna_flash_attn_2, "fwd") and hasattr(torch.ops.rdna_flash_attn_2, "bwd")
        print("loaded from the folder")
    """, cwd=custom_nodes.parent)
    assert out.strip() == "loaded from the folder"


def test_a_broken_install_loads_with_no_nodes_and_one_log_line(tmp_path, caplog):
    broken = tmp_path / "custom_nodes" / "broken-rdna-flash-attention"
    (broken / "nodes").mkdir(parents=True)
    (broken / "__init__.py").write_text((REPO_ROOT / "__init__.py").read_text())
    (broken / "nodes" / "__init__.py").write_text("raise ImportError('simulated broken install')\n")
    caplog.set_level(logging.INFO)
    assert load_custom_node(broken) is True
    assert any("RDNA Flash Attention nodes could not be loaded" in r.getMessage() for r in caplog.records)


def test_nodes_pass_through_when_the_core_cannot_load(model_node, vae_node, node_package, monkeypatch):
    monkeypatch.setattr(node_package.definitions, "core_or_reason", lambda: "rdna_flash_attn cannot be imported (test)")

    class Model:
        def __init__(self):
            self.model_options = {"transformer_options": {}}

        def clone(self):
            return self

    model, vae = Model(), object()
    assert model_node.patch(model, True, True, "original backend") == (model,)
    assert model.model_options["transformer_options"] == {}
    assert vae_node.patch(vae, True, "bf16", "first decode") == (vae,)
