"""What the dispatch layer learns lives in one object, dispatch.state.state: no module of the layer
rebinds a module-level name or holds mutable data at module level beside it."""

from __future__ import annotations

import ast
import importlib
import threading
from collections import Counter
from contextvars import ContextVar
from pathlib import Path

import pytest

from rdna_flash_attn import dispatch
from rdna_flash_attn.dispatch.state import DispatchState, state

MODULES = sorted(path.stem for path in Path(dispatch.__file__).parent.glob("*.py") if path.stem != "__init__")
MUTABLE = (dict, list, set, bytearray, Counter, ContextVar, type(threading.Lock()), DispatchState)


@pytest.mark.parametrize("name", MODULES)
def test_no_module_of_the_dispatch_layer_rebinds_a_global(name):
    module = importlib.import_module(f"rdna_flash_attn.dispatch.{name}")
    tree = ast.parse(Path(module.__file__).read_text(encoding="utf-8"))
    assert not [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Global)]


@pytest.mark.parametrize("name", MODULES)
def test_the_registry_is_the_only_mutable_module_level_value(name):
    module = importlib.import_module(f"rdna_flash_attn.dispatch.{name}")
    mutable = {key for key, value in vars(module).items()
               if not key.startswith("__") and isinstance(value, MUTABLE) and value is not state}
    assert mutable == set()


def test_forgetting_devices_keeps_the_counters_and_the_registry():
    state.kernel_calls = 3
    dispatch.state.forget_devices()
    assert dispatch.state.state is state and state.kernel_calls == 3 and not state.devices and not state.plans
