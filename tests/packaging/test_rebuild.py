"""The local rebuild without compiling for real: compiler search (ROCm, HIP SDK, system clang, too
old, missing), target checks, the build into the user cache with progress, and its command line. The
real clang-19 build, compared byte for byte with prebuilt/, is dev/verify_builds.sh."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import tomllib

import rdna_flash_attn
from rdna_flash_attn.runtime import artifacts, build_facts
from rdna_flash_attn.tools import cli, rebuild

from .conftest import REPO_PREBUILT, REPO_ROOT, fallback_reason_of_one_call


@pytest.fixture
def only_on_path(monkeypatch, tmp_path):
    """PATH holds only the given folders, and no ROCm/HIP SDK is set up (so no real clang is found)."""

    def restrict(*folders: Path) -> None:
        monkeypatch.setenv("PATH", ":".join(str(f) for f in folders) or str(tmp_path / "empty"))
        monkeypatch.setenv("ROCM_PATH", str(tmp_path / "no_rocm"))
        monkeypatch.delenv("HIP_PATH", raising=False)

    return restrict


def test_manifest_source_hash_matches_the_sources():
    manifest = json.loads((REPO_PREBUILT / "manifest.json").read_text())
    assert manifest["source_hash"] == artifacts.source_hash(REPO_ROOT / "kernels")
    assert sorted(manifest["targets"]) == sorted(build_facts.PREBUILT_TARGETS)
    assert sorted(manifest["targets_cov4"]) == sorted(build_facts.LEGACY_TARGETS)


@pytest.mark.parametrize("version", [5, 4])
def test_the_clang_command_is_the_prebuilt_one(version):
    command = rebuild.clang_command("clang-19", "gfx1100", Path("/gen"), Path("/out.hsaco"), REPO_ROOT / "kernels",
                                    code_object_version=version)
    assert command == ["clang-19", "-x", "hip", "--cuda-device-only", "--no-gpu-bundle-output", "-nogpulib",
                       "-nogpuinc", "-O3", "-std=c++17", "-cuid=rdna_flash_attn", f"-mcode-object-version={version}",
                       "--offload-arch=gfx1100", "-I/gen", str(REPO_ROOT / "kernels" / "attention.hip"),
                       "-o", "/out.hsaco"]


def test_v4_is_built_beside_v5_for_the_targets_hip_5_knows():
    assert build_facts.code_object_versions("gfx1100") == (5, 4)
    assert build_facts.code_object_versions("gfx1201") == (5,)
    assert build_facts.artifact_name("gfx1101", 4) == "rdna_fa_gfx1101.cov4.hsaco"
    assert build_facts.artifact_name("gfx1101") == build_facts.artifact_name("gfx1101", 5) == "rdna_fa_gfx1101.hsaco"


@pytest.mark.parametrize("target", ["gfx90a", "gfx1030", "sm_90", "gfx11", ""])
def test_non_rdna_targets_are_refused(target):
    with pytest.raises(rebuild.BuildError, match="is not an RDNA3/RDNA4 GPU target"):
        rebuild.check_target(target)


def test_rocm_clang_is_found_through_rocm_path(fake_clang, only_on_path, monkeypatch, tmp_path):
    only_on_path()
    rocm = tmp_path / "rocm"
    (rocm / "llvm" / "bin").mkdir(parents=True)
    fake_clang("AMD clang version 19.0.0git (roc-6.4.0)").rename(rocm / "llvm" / "bin" / "clang")
    monkeypatch.setenv("ROCM_PATH", str(rocm))
    compiler = rebuild.find_clang()
    assert compiler.path == str(rocm / "llvm" / "bin" / "clang") and compiler.major == 19


def test_hip_sdk_clang_is_found_through_hip_path(fake_clang, only_on_path, monkeypatch, tmp_path):
    only_on_path()
    sdk = tmp_path / "hip_sdk"
    (sdk / "bin").mkdir(parents=True)
    fake_clang("clang version 19.0.0git (AMD HIP SDK 6.2)").rename(sdk / "bin" / "clang")
    monkeypatch.setenv("HIP_PATH", str(sdk))
    assert rebuild.find_clang().path == str(sdk / "bin" / "clang")


def test_sdk_candidates_name_the_platforms_clang_file(monkeypatch):
    """Python before 3.12 adds no PATHEXT to a path in shutil.which(), so Windows names clang.exe."""
    assert rebuild.CLANG_FILE == ("clang.exe" if os.name == "nt" else "clang")
    monkeypatch.setattr(rebuild, "CLANG_FILE", "clang.exe")
    monkeypatch.setenv("HIP_PATH", "C:/AMD/ROCm/6.2")
    monkeypatch.delenv("ROCM_PATH", raising=False)
    assert str(Path("C:/AMD/ROCm/6.2") / "bin" / "clang.exe") in rebuild.clang_candidates()


def test_clang_19_comes_before_rocm_and_newer_clangs(monkeypatch):
    monkeypatch.setenv("ROCM_PATH", "/opt/rocm-6.4")
    candidates = rebuild.clang_candidates()
    assert candidates[0] == "clang-19"
    assert candidates.index("/opt/rocm-6.4/llvm/bin/clang") < candidates.index("clang-20") < candidates.index("clang")


def test_too_old_clang_is_one_clear_message(fake_clang, only_on_path):
    old = fake_clang("Ubuntu clang version 15.0.7", name="clang")
    only_on_path(old.parent)
    with pytest.raises(rebuild.BuildError) as caught:
        rebuild.find_clang()
    message = str(caught.value)
    assert message.startswith("no clang >= 19 found; too old or unusable: ")
    assert f"{old}: Ubuntu clang version 15.0.7" in message and "apt-get install clang-19" in message


def test_no_clang_at_all_is_one_clear_message(only_on_path):
    only_on_path()
    with pytest.raises(rebuild.BuildError, match=r"^no clang found \(looked for clang-19"):
        rebuild.find_clang()


def test_cli_with_a_too_old_clang_changes_nothing_and_sdpa_keeps_running(fake_clang, amd_gpu, capsys):
    amd_gpu.target = "gfx1153"
    old = fake_clang("clang version 16.0.6")
    assert cli.main(["rebuild", "--target", "gfx1153", "--clang", str(old)]) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in err and out == ""
    assert err.splitlines() == [
        (f"rebuild: no clang >= 19 found; too old or unusable: {old}: clang version 16.0.6. "
         "Install clang-19 (Debian/Ubuntu: apt-get install clang-19 lld-19) or ROCm 6.4+, or pass --clang."),
        "rebuild: nothing changed; attention keeps running where it did (prebuilt kernels or PyTorch SDPA)",
    ]
    assert not artifacts.local_build_dir().exists()
    assert "no prebuilt code object for gfx1153" in fallback_reason_of_one_call()


def test_cli_refuses_an_unknown_target(capsys):
    assert cli.main(["rebuild", "--target", "gfx90a"]) == 1
    assert "rebuild: 'gfx90a' is not an RDNA3/RDNA4 GPU target" in capsys.readouterr().err


@pytest.mark.parametrize("target", ["gfx1170", "gfx1171"])
def test_cli_refuses_rdna4m_targets_whatever_the_compiler(fake_clang, target, capsys):
    clang = fake_clang("clang version 22.1.8")
    assert cli.main(["rebuild", "--target", target, "--clang", str(clang)]) == 1
    err = capsys.readouterr().err
    assert f"rebuild: {target} is an RDNA 4m APU: it runs gfx12-style WMMA under a gfx11 number" in err
    assert not artifacts.local_build_dir().exists()


def test_cli_without_a_gpu_or_target_asks_for_one(capsys):
    assert cli.main(["rebuild"]) == 1
    assert "name the target, e.g. --target gfx1100" in capsys.readouterr().err


def test_clang_that_does_not_know_the_target(fake_clang):
    clang = fake_clang("clang version 19.1.7", compile_ok=False,
                       stderr="clang: error: unsupported CUDA gpu architecture: gfx1153\n")
    with pytest.raises(rebuild.BuildError, match=r"clang version 19.1.7 does not know gfx1153: a newer clang"):
        rebuild.build_local(["gfx1153"], clang=str(clang), progress=lambda line: None)
    assert list(artifacts.local_build_dir().iterdir()) == []  # no code object, no partial file


def test_build_into_the_user_cache_is_used_by_the_runtime(fake_clang, amd_gpu, capsys):
    amd_gpu.target = "gfx1153"
    clang = fake_clang("clang version 19.1.7")
    assert cli.main(["rebuild", "--target", "gfx1153,gfx1100", "--clang", str(clang), "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    folder = artifacts.local_build_dir()
    assert folder.parent == Path(rdna_flash_attn.settings.cache_dir) / "kernels"
    assert re.search(r"\[\d/3\] gfx1153: compiling code object v5 \(\d+ kernels", out)
    assert re.search(r"\[\d/3\] gfx1153: v5 done in", out) and re.search(r"\[\d/3\] gfx1100: v4 done in", out)
    assert "no GPU of these targets here: the self-test runs on first use" in out  # torch sees no GPU here

    # what clang was asked: the prebuilt command, with the generated variant list on the include path
    compiled = (folder / "rdna_fa_gfx1153.hsaco").read_text().split()
    assert compiled[:-3] == build_facts.clang_flags(5) + ["--offload-arch=gfx1153"]
    compiled_v4 = (folder / "rdna_fa_gfx1100.cov4.hsaco").read_text().split()
    assert compiled_v4[:-3] == build_facts.clang_flags(4) + ["--offload-arch=gfx1100"]
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["source_hash"] == artifacts.source_hash() and manifest["compiler"] == "clang version 19.1.7"
    assert sorted(manifest["targets"]) == ["gfx1100", "gfx1153"] and sorted(manifest["targets_cov4"]) == ["gfx1100"]
    assert list(folder.glob(".*")) == []  # no partial files left

    artifact = artifacts.amd_artifact("gfx1153")
    assert artifact.local and artifact.read_verified() == (folder / "rdna_fa_gfx1153.hsaco").read_bytes()
    assert artifacts.amd_artifact("gfx1100").local  # the user asked: preferred to the prebuilt one

    assert cli.main(["rebuild", "--clear"]) == 0
    assert not artifacts.amd_artifact("gfx1100").local and not folder.exists()


def test_an_unwritable_cache_folder_is_one_clear_line(fake_clang, capsys, tmp_path):
    blocker = tmp_path / "a_file"  # a folder cannot be made inside a file, whoever runs the test
    blocker.write_text("")
    rdna_flash_attn.settings.cache_dir = str(blocker / "cache")
    clang = fake_clang("clang version 19.1.7")
    assert cli.main(["rebuild", "--target", "gfx1100", "--clang", str(clang)]) == 1
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "building" not in out
    assert err.splitlines()[0] == (f"rebuild: cannot write to the cache folder {artifacts.local_build_dir()} "
                                   "(Not a directory): set RDNA_FA_CACHE_DIR to a writable folder")


def test_clear_that_cannot_delete_says_so(capsys):
    root = artifacts.local_builds_root()
    root.parent.mkdir(parents=True, exist_ok=True)
    root.write_text("")  # not a folder: rmtree fails, as on a folder the user may not write
    assert cli.main(["rebuild", "--clear"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        f"rebuild: could not delete every local build under {root}; delete that folder by hand, "
        "or set RDNA_FA_CACHE_DIR to another folder"]


def test_doctor_shows_prebuilt_local_builds_and_compiler(prebuilt_copy, fake_clang, only_on_path, capsys):
    (prebuilt_copy / "rdna_fa_gfx1101.hsaco").write_bytes(b"x")
    clang = fake_clang("clang version 20.1.0", name="clang-20")
    only_on_path(clang.parent)
    rebuild.build_local(["gfx1153"], progress=lambda line: None)
    capsys.readouterr()
    assert cli.main(["doctor"]) == 0
    out = re.sub(r" +", " ", capsys.readouterr().out)
    assert f"prebuilt {prebuilt_copy}: 8 targets sha256-verified (gfx1100, gfx1102," in out
    assert "PROBLEM gfx1101: rdna_fa_gfx1101.hsaco does not match the sha256" in out
    assert f"local builds {artifacts.local_build_dir()}: gfx1153 (used instead of prebuilt)" in out
    assert f"compiler {clang} (clang version 20.1.0)" in out


def test_packaging_metadata_never_pulls_torch():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert project["project"]["version"] == rdna_flash_attn.__version__
    assert project["project"]["dependencies"] == []
    requirements = [line.strip() for line in (REPO_ROOT / "requirements.txt").read_text().splitlines()]
    assert [line for line in requirements if line and not line.startswith("#")] == []
    assert project["tool"]["comfy"]["DisplayName"] == "RDNA Flash Attention"
