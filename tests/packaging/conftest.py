"""Fixtures of the packaging tests: a private, damageable copy of prebuilt/ that the package loads
from, a private local-build cache, an AMD GPU whose code object the real runtime opens through a fake
HIP runtime, and fake clang executables."""

from __future__ import annotations

import shutil
import stat
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

import rdna_flash_attn
from rdna_flash_attn.runtime import artifacts, device, driver, loader as runtime
from rdna_flash_attn.dispatch import router as dispatch
from rdna_flash_attn.config import settings

REPO_ROOT = Path(__file__).resolve().parents[2]
REPO_PREBUILT = REPO_ROOT / "prebuilt"
ZLUDA_NAME = "AMD Radeon RX 7900 XTX [ZLUDA]"


def fallback_reason_of_one_call() -> str:
    """Run one attention call, check it equals SDPA's, and return the fallback reason counted."""
    q, k, v = (torch.randn(2, 3, 40, 64, dtype=torch.float16) for _ in range(3))
    out = rdna_flash_attn.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.equal(out, dispatch.torch_sdpa(q, k, v, is_causal=True))
    (reason,) = rdna_flash_attn.stats()["fallback_reasons"]
    return reason


@pytest.fixture
def prebuilt_copy(tmp_path, monkeypatch) -> Path:
    """A copy of prebuilt/ (with install.py beside it) that artifacts.prebuilt_dir() returns."""
    root = tmp_path / "node"
    shutil.copytree(REPO_PREBUILT, root / "prebuilt")
    shutil.copy2(REPO_ROOT / "install.py", root / "install.py")
    facts = root / "rdna_flash_attn" / "runtime" / "build_facts.py"  # what install.py reads the manifest with
    facts.parent.mkdir(parents=True)
    shutil.copy2(REPO_ROOT / "rdna_flash_attn" / "runtime" / "build_facts.py", facts)
    monkeypatch.setattr(artifacts, "prebuilt_dir", lambda: root / "prebuilt")
    artifacts.load_manifest.cache_clear()
    yield root / "prebuilt"
    artifacts.load_manifest.cache_clear()


@pytest.fixture
def local_cache(tmp_path) -> Path:
    """settings.cache_dir (the autouse `isolated` fixture already points it at a private folder)."""
    return Path(settings.cache_dir)


# e_ident[EI_ABIVERSION] of an AMDGPU HSA code object: 2 is code object v4, 3 is v5 (AMDGPUUsage.rst).
ELF_ABI_VERSION_BYTE = 8
CODE_OBJECT_VERSION_OF_ABI_BYTE = {2: 4, 3: 5}


def code_object_version_of(data: bytes) -> int:
    return CODE_OBJECT_VERSION_OF_ABI_BYTE[data[ELF_ABI_VERSION_BYTE]]


class FakeHip:
    """The HIP runtime as KernelLibrary uses it when opening a code object: reports `version`, records
    what it loads, and refuses code objects whose version (read from the ELF header) is in `refuses`,
    with the error a HIP runtime gives."""

    def __init__(self):
        self.version = "6.2.41512"
        self.refuses: set[int] = set()
        self.loaded: list[bytes] = []

    def runtime_version(self) -> str:
        return self.version

    def load_module(self, data: bytes, ordinal: int) -> object:
        if code_object_version_of(data) in self.refuses:
            raise driver.DriverError("hipModuleLoadData failed: no kernel image is available for execution on "
                                     "the device (209)")
        self.loaded.append(data)
        return object()


@pytest.fixture
def amd_gpu(monkeypatch):
    """Every device is an RX 7900 XTX under ZLUDA with `amd_gpu.target` as its GPU target; the real
    runtime and artifacts code open its code object, through a fake HIP runtime."""
    state = types.SimpleNamespace(target="gfx1100", hip=FakeHip())
    monkeypatch.setattr(device, "describe",
                        lambda dev: device.DeviceInfo("zluda", ZLUDA_NAME, 0, state.target, "6.2.41512"))
    monkeypatch.setattr(driver, "hip_driver", lambda zluda: state.hip)
    monkeypatch.setattr(runtime, "_libraries", {})
    monkeypatch.setattr(runtime, "_failures", {})
    return state


@pytest.fixture
def fake_clang(tmp_path):
    """make(version_line, compile_ok=True, stderr="") -> path of an executable that answers --version
    with version_line and otherwise writes its own command line to the -o file (or fails with stderr)."""

    def make(version_line: str, compile_ok: bool = True, stderr: str = "", name: str = "clang") -> Path:
        folder = tmp_path / f"bin_{len(list(tmp_path.glob('bin_*')))}"
        folder.mkdir()
        path = folder / name
        path.write_text(textwrap.dedent(f"""\
            #!{sys.executable}
            import sys
            args = sys.argv[1:]
            if args == ["--version"]:
                print({version_line!r})
                sys.exit(0)
            if not {compile_ok!r}:
                sys.stderr.write({stderr!r})
                sys.exit(1)
            with open(args[args.index("-o") + 1], "w") as out:
                out.write(" ".join(args[:-1]))
            """))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
        return path

    return make
