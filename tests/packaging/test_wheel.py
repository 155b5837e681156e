"""The universal wheel, built from this repository as pip builds it: the package's modules, its code
objects and kernel sources, and nothing of the repository's lab (the CPU interpreter, the host
harnesses, the static report and estimates), bench or tests."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from .conftest import REPO_ROOT

# The lab's modules that lived in the package before: none may come back into it under any folder.
LAB_ONLY = re.compile(r"(^|/)(interpreter|hosts)/|harness|host_code|coverage|resource_report|report\.py|"
                      r"estimates?\.py|expected_speed|interpreted|throughput_estimate")
NO_NETWORK = ("No matching distribution found for hatchling", "Could not find a version that satisfies")


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> set[str]:
    """The file names in the wheel pip builds from the repository (hatchling, as pyproject.toml pins it)."""
    out = tmp_path_factory.mktemp("dist")
    # With hatchling already installed no index is needed; otherwise pip fetches the pinned one.
    isolation = [] if importlib.util.find_spec("hatchling") is None else ["--no-build-isolation"]
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", *isolation, "-w", str(out),
                            str(REPO_ROOT)], capture_output=True, text=True, timeout=600)
    if built.returncode != 0 and any(text in built.stderr for text in NO_NETWORK):
        pytest.skip(f"hatchling cannot be fetched to build the wheel: {built.stderr.strip().splitlines()[-1]}")
    assert built.returncode == 0, built.stderr
    (wheel,) = out.glob("rdna_flash_attn-*-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


def test_the_wheel_holds_the_package_and_nothing_of_the_lab_bench_or_tests(wheel_names):
    modules = {name for name in wheel_names if name.endswith(".py")}
    package = {path.relative_to(REPO_ROOT).as_posix() for path in (REPO_ROOT / "rdna_flash_attn").rglob("*.py")}
    assert modules == package
    assert not [name for name in wheel_names if name.startswith(("rdna_fa_lab/", "bench/", "tests/"))]
    assert not [name for name in modules if LAB_ONLY.search(name)]


def test_the_wheel_takes_only_the_package_code_objects_and_kernel_sources():
    wheel = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]
    assert wheel["only-include"] == ["rdna_flash_attn", "prebuilt", "kernels"]


@pytest.mark.parametrize("name", ["rdna_flash_attn/tools/coverage.py", "rdna_flash_attn/interpreter/wave.py",
                                  "rdna_flash_attn/tools/comfyui_harness.py", "rdna_flash_attn/tools/report.py",
                                  "rdna_flash_attn/tools/estimates.py", "rdna_flash_attn/tools/interpreted.py",
                                  "rdna_flash_attn/hosts/host_code.py"])
def test_a_lab_module_in_the_package_would_be_caught(name):
    assert LAB_ONLY.search(name)


def test_the_packages_own_modules_pass():
    assert not [path for path in (REPO_ROOT / "rdna_flash_attn").rglob("*.py")
                if LAB_ONLY.search(Path(path).relative_to(REPO_ROOT).as_posix())]
