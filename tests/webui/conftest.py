"""WebUI extension tests: the host fakes on sys.path per test, and every piece of extension and host
state put back afterwards (patched class forwards, rebound module globals, settings toggles)."""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

import pytest

from extension import attention_functions, availability, entry, forge, guard, options, reforge

FAKES = Path(__file__).parent / "fakes"
HOST_PACKAGES = ("modules", "backend", "modules_forge", "sgm", "ldm_patched")
FAKE_ROOTS = {"a1111": ("a1111",), "forge": ("forge", "a1111"), "reforge": ("reforge", "a1111")}


def _drop_host_modules() -> None:
    for name in list(sys.modules):
        if name.split(".")[0] in HOST_PACKAGES:
            del sys.modules[name]
    # inspect remembers each module's file by name: a real WebUI's namespace package of a fake's name
    # would then fail inspect.getmodule (which torch.library.custom_op calls at reForge's import)
    for name in list(inspect._filesbymodname):
        if name.split(".")[0] in HOST_PACKAGES:
            del inspect._filesbymodname[name]


def _ldm_classes():
    try:
        import ldm.modules.attention
        import ldm.modules.diffusionmodules.model
    except ImportError:
        return []
    return [ldm.modules.attention.CrossAttention, ldm.modules.diffusionmodules.model.AttnBlock]


@pytest.fixture(autouse=True)
def extension_state():
    classes = _ldm_classes()
    forwards = {cls: cls.forward for cls in classes}
    yield
    forge.restore()
    reforge.restore()
    for cls, forward in forwards.items():
        cls.forward = forward
    options.toggles.unet = options.toggles.vae = True
    options._subscribers.clear()
    availability._explained.clear()
    guard._reported.clear()
    attention_functions._unknown_forms_logged.clear()
    entry._said_no_host = False
    _drop_host_modules()


@pytest.fixture
def webui(monkeypatch):
    """webui("a1111"), webui("forge") or webui("reforge"): that WebUI's fake host modules importable;
    returns its modules.shared."""

    def start(kind: str):
        if kind == "a1111":
            pytest.importorskip("ldm.modules.attention", reason="stable-diffusion-sdkit (ldm) not installed")
        _drop_host_modules()
        for root in reversed(FAKE_ROOTS[kind]):
            monkeypatch.syspath_prepend(str(FAKES / root))
        return importlib.import_module("modules.shared")

    return start
