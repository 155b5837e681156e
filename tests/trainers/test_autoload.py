"""The .pth hook: off unless RDNA_FA_PATCH_SDPA (or RDNA_FA_ATEN_OPS) is set when the program imports
torch (at start, or by the program itself before its `import torch`, as ai-toolkit does from its .env
file); then the override is installed right after that import (nothing imported earlier); a failure never
stops the interpreter. Proved with a real interpreter start in a virtual environment holding the hook."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from rdna_flash_attn.integrations import autoload
from rdna_flash_attn.dispatch import sdpa_patch

from ..child_venv import venv_seeing_this_one
from .conftest import REPO_ROOT, run_child

HOOK = REPO_ROOT / "rdna_flash_attn_autoload.pth"

PROBE = """
import json, sys
seen = dict(torch_at_start="torch" in sys.modules, package_at_start="rdna_flash_attn" in sys.modules)
import torch
import torch.nn.functional as F
seen["patched"] = F.scaled_dot_product_attention.__module__ == "rdna_flash_attn.dispatch.router"
q = torch.randn(1, 2, 8, 16)
F.scaled_dot_product_attention(q, q, q)
seen["counted"] = sys.modules["rdna_flash_attn"].stats()["fallback"] if "rdna_flash_attn" in sys.modules else 0
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def hooked_python(tmp_path_factory):
    """A virtual environment (this one's packages visible, for torch) whose site-packages holds the hook."""
    python, purelib = venv_seeing_this_one(tmp_path_factory.mktemp("venv"))
    shutil.copy(HOOK, purelib)
    return str(python)


def test_hook_is_one_line_that_loads_only_the_small_autoload_module():
    lines = HOOK.read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("import sys;") and "'integrations', 'autoload.py'" in lines[0]


def test_hook_honours_the_variable_set_by_the_program_before_it_imports_torch(hooked_python, child_env):
    # ai-toolkit's run.py loads its .env (load_dotenv) before `import torch`.
    program = "import os\nos.environ['RDNA_FA_PATCH_SDPA'] = '1'\n" + PROBE
    child = run_child([hooked_python, "-c", program], child_env)
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout) == dict(torch_at_start=False, package_at_start=False, patched=True, counted=1)


def test_hook_off_without_the_variable(hooked_python, child_env):
    child = run_child([hooked_python, "-c", PROBE], child_env)
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout) == dict(torch_at_start=False, package_at_start=False, patched=False, counted=0)
    assert child.stderr == ""


def test_hook_installs_the_override_after_the_programs_own_torch_import(hooked_python, child_env):
    child = run_child([hooked_python, "-c", PROBE], dict(child_env, RDNA_FA_PATCH_SDPA="1"))
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout) == dict(torch_at_start=False, package_at_start=False, patched=True, counted=1)


def test_hook_failure_never_stops_the_program(hooked_python, child_env, tmp_path):
    # A broken installation: the package's autoload.py is there, its __init__ raises.
    broken = tmp_path / "rdna_flash_attn"
    (broken / "integrations").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "rdna_flash_attn" / "integrations" / "autoload.py", broken / "integrations")
    shutil.copy(REPO_ROOT / "rdna_flash_attn" / "environment.py", broken)
    (broken / "__init__.py").write_text("raise ImportError('broken install')\n")
    env = dict(child_env, RDNA_FA_PATCH_SDPA="1", PYTHONPATH=str(tmp_path))
    # cwd: not the checkout, whose working package `python -c` would find first
    child = run_child([hooked_python, "-c", "import torch; print(torch.ones(2).sum().item())"], env, cwd=tmp_path)
    assert child.returncode == 0 and child.stdout.strip() == "2.0"
    assert child.stderr.count("RDNA_FA_PATCH_SDPA") == 1 and "ImportError: broken install" in child.stderr

    # No package at all: the hook itself reports once and the interpreter goes on.
    child = run_child([hooked_python, "-c", "print('up')"], dict(env, PYTHONPATH=str(tmp_path / "empty")), cwd=tmp_path)
    assert child.returncode == 0 and child.stdout.strip() == "up"
    assert child.stderr.count("RDNA_FA_PATCH_SDPA is set but the hook failed") == 1


@pytest.mark.parametrize("value, wanted", [("1", True), ("yes", True), (" ON ", True), ("", False),
                                           ("0", False), ("off", False), ("2", False)])
def test_variable_values(value, wanted):
    assert autoload.requested({"RDNA_FA_PATCH_SDPA": value}) is wanted
    assert autoload.requested({}) is False


@pytest.mark.parametrize("read, variable", [(autoload.requested, "RDNA_FA_PATCH_SDPA"),
                                            (autoload.flash_attn_requested, "RDNA_FA_FLASH_ATTN")])
@pytest.mark.parametrize("value", ["2", "enable"])
def test_a_bad_value_is_off_with_one_warning_naming_it(read, variable, value, log_records):
    assert read({variable: value}) is False and read({variable: value}) is False
    (record,) = log_records.records
    assert record.levelno == logging.WARNING
    assert f"ignoring {variable}={value!r}: expected 1 or 0" in record.getMessage()
    assert record.getMessage().endswith("using 0 instead")


def test_hook_warns_once_about_bad_values_and_stays_off(hooked_python, child_env):
    env = dict(child_env, RDNA_FA_PATCH_SDPA="enable", RDNA_FA_FLASH_ATTN="2")
    child = run_child([hooked_python, "-c", "import flash_attn"], env)
    assert child.returncode != 0 and "No module named 'flash_attn'" in child.stderr
    child = run_child([hooked_python, "-c", PROBE], env)
    assert child.returncode == 0, child.stderr
    assert json.loads(child.stdout) == dict(torch_at_start=False, package_at_start=False, patched=False, counted=0)
    assert child.stderr.count("ignoring RDNA_FA_PATCH_SDPA='enable'") == 1
    assert child.stderr.count("ignoring RDNA_FA_FLASH_ATTN='2'") == 1


def test_install_with_torch_already_imported_patches_at_once(monkeypatch):
    monkeypatch.setenv("RDNA_FA_PATCH_SDPA", "1")
    autoload.install()
    assert sdpa_patch.sdpa_patch_enabled()


def test_install_errors_are_logged_not_raised(monkeypatch, log_records):
    monkeypatch.setenv("RDNA_FA_PATCH_SDPA", "1")

    def broken():
        raise RuntimeError("no HIP runtime")

    monkeypatch.setattr(sdpa_patch, "enable_sdpa_patch", broken)
    monkeypatch.setattr("rdna_flash_attn.enable_sdpa_patch", broken)
    autoload.install()
    warnings = [r for r in log_records.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no HIP runtime" in warnings[0].getMessage()
    assert not sdpa_patch.sdpa_patch_enabled()


ATEN_PROBE = ("import json, torch; print(json.dumps(torch._C._dispatch_has_kernel_for_dispatch_key("
              "'aten::_scaled_dot_product_flash_attention', 'CUDA')))")


@pytest.mark.skipif(not hasattr(torch.library, "get_kernel"), reason="needs PyTorch 2.9 or newer")
def test_hook_serves_the_aten_flash_ops_after_torch_import_when_asked(hooked_python, child_env):
    # PyTorch's CPU builds have no CUDA kernel for the op: ours is the one the probe sees.
    served = run_child([hooked_python, "-c", ATEN_PROBE], dict(child_env, RDNA_FA_ATEN_OPS="1", RDNA_FA_FORCE="1"))
    assert served.returncode == 0 and json.loads(served.stdout) is True, served.stderr
    cpu_build = run_child([hooked_python, "-c", ATEN_PROBE], dict(child_env, RDNA_FA_ATEN_OPS="1"))
    assert json.loads(cpu_build.stdout) is False
    assert cpu_build.stderr.count("not serving torch's flash attention ops: not a ROCm build of PyTorch") == 1
    off = run_child([hooked_python, "-c", ATEN_PROBE], child_env)
    assert json.loads(off.stdout) is False and off.stderr == ""
