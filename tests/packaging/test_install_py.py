"""install.py, the host install hook: one status line, exit 0, fast, no torch, and a damaged code
object reported here and refused by the runtime."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import rdna_flash_attn
from rdna_flash_attn.runtime import artifacts
from rdna_flash_attn.dispatch import router as dispatch

from .conftest import REPO_ROOT

# The hook's own work must stay far below a second; the rest of a run is the interpreter starting.
OWN_WORK_LIMIT_S = 0.5


def run_hook(node: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    """Run install.py as a host does (a subprocess, its folder as cwd); (result, wall seconds)."""
    started = time.perf_counter()
    result = subprocess.run([sys.executable, str(node / "install.py"), *args], cwd=node,
                            capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60, check=False)
    return result, time.perf_counter() - started


def python_startup_s() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=60)
    return time.perf_counter() - started


def damage(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_clean_install_prints_one_line_and_is_fast(prebuilt_copy):
    baseline = python_startup_s()
    result, wall = run_hook(prebuilt_copy.parent)
    assert result.returncode == 0 and result.stderr == ""
    lines = result.stdout.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("[RDNA Flash Attention] 9 GPU code objects verified (gfx1100-gfx1201)")
    own = float(lines[0].split(" in ")[1].split(" s")[0])
    assert own < OWN_WORK_LIMIT_S
    assert wall - baseline < OWN_WORK_LIMIT_S + 0.5, f"install.py took {wall:.2f} s, python itself {baseline:.2f} s"


def test_committed_prebuilt_passes_strict():
    result, _ = run_hook(REPO_ROOT, "--strict")
    assert result.returncode == 0, result.stdout


def test_install_py_imports_neither_torch_nor_the_package(prebuilt_copy):
    probe = ("import runpy, sys\n"
             "try:\n    runpy.run_path(sys.argv[1], run_name='__main__')\nexcept SystemExit:\n    pass\n"
             "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'rdna_flash_attn', 'numpy'))\n"
             "assert not loaded, loaded\n")
    result = subprocess.run([sys.executable, "-c", probe, str(prebuilt_copy.parent / "install.py")],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr


def test_tampered_code_object_is_reported_and_refused_by_the_runtime(prebuilt_copy, amd_gpu):
    damage(prebuilt_copy / "rdna_fa_gfx1100.hsaco")

    result, _ = run_hook(prebuilt_copy.parent)
    assert result.returncode == 0  # the host still starts; the runtime refuses the file itself
    (line,) = result.stdout.splitlines()
    assert "WARNING" in line and "gfx1100: rdna_fa_gfx1100.hsaco does not match the sha256" in line
    assert "PyTorch SDPA" in line and "reinstall" in line
    assert run_hook(prebuilt_copy.parent, "--strict")[0].returncode == 1

    with pytest.raises(artifacts.ArtifactError, match="does not match the sha256"):
        artifacts.amd_artifact("gfx1100").read_verified()

    # The dispatcher: the GPU's code object is refused, so the call runs on SDPA, with that reason.
    q, k, v = (torch.randn(1, 2, 64, 64, dtype=torch.float16) for _ in range(3))
    out = rdna_flash_attn.scaled_dot_product_attention(q, k, v)
    assert torch.equal(out, dispatch.torch_sdpa(q, k, v))
    (reason,) = rdna_flash_attn.stats()["fallback_reasons"]
    assert "rdna_fa_gfx1100.hsaco does not match the sha256" in reason
    assert amd_gpu.hip.loaded == []  # nothing reached the HIP runtime


@pytest.mark.parametrize("breakage, expected", [
    ("manifest_garbage", "prebuilt/manifest.json is damaged"),
    ("manifest_missing", "prebuilt/manifest.json is missing"),
    ("manifest_no_targets", "prebuilt/manifest.json is damaged"),
    ("artifact_missing", "gfx1201: rdna_fa_gfx1201.hsaco is missing"),
])
def test_broken_prebuilt_folder_is_one_warning_and_exit_0(prebuilt_copy, breakage, expected):
    manifest = prebuilt_copy / "manifest.json"
    if breakage == "manifest_garbage":
        manifest.write_text('{"targets": {"gfx1100": ')
    elif breakage == "manifest_missing":
        manifest.unlink()
    elif breakage == "manifest_no_targets":
        manifest.write_text(json.dumps({"abi_version": 1}))
    else:
        (prebuilt_copy / "rdna_fa_gfx1201.hsaco").unlink()
    result, _ = run_hook(prebuilt_copy.parent)
    assert result.returncode == 0 and result.stderr == ""
    (line,) = result.stdout.splitlines()
    assert "WARNING" in line and expected in line


@pytest.mark.parametrize("entry", [{"file": "rdna_fa_gfx1201.hsaco"}, "rdna_fa_gfx1201.hsaco", {"file": 3, "sha256": ""}])
def test_one_bad_entry_costs_its_target_only_as_in_the_runtime(prebuilt_copy, entry):
    manifest_path = prebuilt_copy / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["targets"]["gfx1201"] = entry
    manifest_path.write_text(json.dumps(manifest))
    good = [target for target in manifest["targets"] if target != "gfx1201"]

    result, _ = run_hook(prebuilt_copy.parent)
    assert result.returncode == 0 and result.stderr == ""
    (line,) = result.stdout.splitlines()
    assert "WARNING: gfx1201: its manifest entry is malformed." in line
    assert f"{len(good)} GPU targets verified ({', '.join(good)}); kernels stay off for the others" in line
    assert artifacts.verify_prebuilt() == (good, ["gfx1201: its manifest entry is malformed"])


def test_the_advised_command_works_from_another_folder(tmp_path):
    # From ComfyUI's root, `python -m rdna_flash_attn doctor` finds no package; the advised command does.
    result, _ = run_hook(REPO_ROOT)
    command = result.stdout.split("details: ", 1)[1].strip()
    assert command.startswith(sys.executable) and command.endswith("install.py --doctor")
    doctor = subprocess.run(command.split(), cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL, check=False)
    assert doctor.returncode == 0, doctor.stderr
    assert doctor.stdout.startswith("rdna_flash_attn") and "sha256-verified" in doctor.stdout
