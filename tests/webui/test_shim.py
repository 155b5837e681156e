"""The scripts/ shim as a WebUI runs it, in a fresh process: it loads without the repository root on
sys.path, explains itself in one console line, and a broken install or a missing GPU never stops the
WebUI's start."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHIM = Path("scripts") / "rdna_flash_attn_webui.py"
FAKE_A1111 = Path(__file__).parent / "fakes" / "a1111"

START_A1111 = f"""
import runpy, sys
sys.path.insert(0, {str(FAKE_A1111)!r})
runpy.run_path(sys.argv[1])
from modules import sd_hijack
sd_hijack.list_optimizers()
print("optimizers:", [x.title() for x in sd_hijack.optimizers])
print("webui started")
"""


def run(code: str, root: Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, str(root / SHIM)], check=False, cwd=cwd, capture_output=True, text=True, timeout=120
    )


def our_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "RDNA Flash Attention" in line]


def test_outside_any_webui_it_says_so_once(tmp_path):
    result = run("import runpy, sys; runpy.run_path(sys.argv[1]); runpy.run_path(sys.argv[1])", REPO, tmp_path)
    assert result.returncode == 0, result.stderr
    assert our_lines(result.stderr) == [
        "RDNA Flash Attention: no supported WebUI found (A1111, Forge, reForge, Forge Classic or SD.Next); not active"
    ]


def test_a1111_without_a_supported_gpu_starts_and_explains_once(tmp_path):
    pytest.importorskip("ldm.modules.attention", reason="stable-diffusion-sdkit (ldm) not installed")
    result = run(START_A1111, REPO, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "optimizers: ['sdp - scaled dot product']" in result.stdout and "webui started" in result.stdout
    assert our_lines(result.stderr) == [
        "RDNA Flash Attention (A1111): not active: CPU tensors (the kernels run on AMD RDNA3/RDNA4 GPUs)"
    ]


def test_a_missing_manifest_leaves_the_webui_starting(tmp_path):
    pytest.importorskip("ldm.modules.attention", reason="stable-diffusion-sdkit (ldm) not installed")
    install = tmp_path / "extensions" / "rdna_flash_attn"
    for folder in ("rdna_flash_attn", "extension", "scripts", "prebuilt"):
        shutil.copytree(REPO / folder, install / folder, ignore=shutil.ignore_patterns("__pycache__"))
    (install / "prebuilt" / "manifest.json").unlink()
    result = run(START_A1111, install, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "webui started" in result.stdout
    (line,) = our_lines(result.stderr)
    assert line.startswith("RDNA Flash Attention (A1111): not active: no kernel manifest at ")
