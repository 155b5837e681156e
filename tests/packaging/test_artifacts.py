"""Where the runtime finds a GPU target's code object (local build, then prebuilt) and what happens
with bad input: a corrupt manifest, a missing code object, a target with none. Each is one clear
reason, and the attention call still runs (on SDPA)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

import rdna_flash_attn
from rdna_flash_attn.runtime import artifacts, build_facts, loader as runtime, variants
from rdna_flash_attn.tools import cli, doctor, rebuild

from .conftest import REPO_PREBUILT, fallback_reason_of_one_call


def make_local_build(target: str, source: str = "gfx1100") -> artifacts.Path:
    """A local build of `target` for the current sources, made of a prebuilt code objects' bytes."""
    folder = artifacts.local_build_dir()
    folder.mkdir(parents=True)
    for version in build_facts.code_object_versions(target):
        shutil.copy2(REPO_PREBUILT / build_facts.artifact_name(source, version), folder / build_facts.artifact_name(target, version))
    rebuild.write_manifest(folder, [target], "test copy")
    return folder


@pytest.mark.parametrize("text, expected", [
    ("{not json", "is unreadable"),
    (json.dumps({"abi_version": variants.ABI_VERSION}), "has no targets table"),
    (json.dumps({"abi_version": variants.ABI_VERSION, "targets": {"gfx1100": {"sha256": "00"}}}),
     "malformed entry for gfx1100"),
])
def test_corrupt_manifest_is_a_clear_reason_and_sdpa_runs(prebuilt_copy, amd_gpu, text, expected):
    (prebuilt_copy / "manifest.json").write_text(text)
    with pytest.raises(artifacts.ArtifactError, match=expected):
        artifacts.amd_artifact("gfx1100")
    reason = fallback_reason_of_one_call()
    assert expected in reason and "reinstall" in reason


def test_missing_code_object_is_a_clear_reason_and_sdpa_runs(prebuilt_copy, amd_gpu):
    (prebuilt_copy / "rdna_fa_gfx1100.hsaco").unlink()
    reason = fallback_reason_of_one_call()
    assert "rdna_fa_gfx1100.hsaco listed in the manifest is missing" in reason and "reinstall" in reason


def test_rdna_target_without_a_prebuilt_names_the_rebuild_command(amd_gpu):
    amd_gpu.target = "gfx1153"
    reason = fallback_reason_of_one_call()
    assert reason.startswith("no prebuilt code object for gfx1153 (prebuilt: gfx1100, ")
    assert "python -m rdna_flash_attn rebuild --target gfx1153" in reason


def test_non_rdna_target_forced_on_says_the_kernels_need_rdna(amd_gpu):
    amd_gpu.target = "gfx90a"
    rdna_flash_attn.settings.force = True  # past the policy, so the artifact lookup itself answers
    reason = fallback_reason_of_one_call()
    assert reason.startswith("no code object for gfx90a: the kernels run on RDNA3/RDNA4 GPUs")


@pytest.mark.parametrize("target", ["gfx1170", "gfx1171"])
def test_rdna4m_never_loads_gfx11_code_even_forced_or_built_locally(amd_gpu, target):
    amd_gpu.target = target
    make_local_build(target)  # gfx11 machine code filed under the RDNA 4m name
    rdna_flash_attn.settings.force = True
    reason = fallback_reason_of_one_call()
    assert reason.startswith(f"{target} is an RDNA 4m APU: it runs gfx12-style WMMA under a gfx11 number, so the "
                             "gfx11 code objects cannot run there")
    assert amd_gpu.hip.loaded == []


def test_doctor_says_plainly_why_rdna4m_runs_on_sdpa(amd_gpu, monkeypatch, capsys):
    amd_gpu.target = "gfx1170"
    monkeypatch.setattr(doctor, "gpu_devices", lambda: [torch.device("cuda", 0)])
    assert cli.main(["doctor"]) == 0
    lines = [" ".join(line.split()) for line in capsys.readouterr().out.splitlines()]
    plain = "gfx1170 is an RDNA 4m APU: it runs gfx12-style WMMA under a gfx11 number"
    assert any(line.startswith(f"gfx target gfx1170: {plain}") for line in lines)
    assert any(line.startswith(f"kernels OFF: {plain}") for line in lines)
    assert amd_gpu.hip.loaded == []


def test_a_local_build_serves_a_target_without_a_prebuilt(amd_gpu):
    amd_gpu.target = "gfx1153"
    folder = make_local_build("gfx1153")
    artifact = artifacts.amd_artifact("gfx1153")
    assert artifact.local and artifact.path == folder / "rdna_fa_gfx1153.hsaco"
    assert runtime.loaded_library_for(torch.device("cuda", 0)).artifact.local
    assert amd_gpu.hip.loaded == [artifact.path.read_bytes()]
    assert artifacts.local_build_targets() == ["gfx1153"]


def test_a_local_build_is_preferred_to_the_prebuilt_one(amd_gpu):
    make_local_build("gfx1100", source="gfx1101")
    assert runtime.loaded_library_for(torch.device("cuda", 0)).artifact.local
    assert amd_gpu.hip.loaded == [(REPO_PREBUILT / "rdna_fa_gfx1101.hsaco").read_bytes()]


def test_local_builds_of_other_sources_are_ignored(amd_gpu):
    folder = make_local_build("gfx1100", source="gfx1101")
    folder.rename(folder.with_name("0123456789abcdef"))  # what an older package version built
    assert not artifacts.amd_artifact("gfx1100").local


def test_a_damaged_local_build_is_refused_and_a_corrupt_local_manifest_skipped(amd_gpu, log_records):
    folder = make_local_build("gfx1100")
    (folder / "rdna_fa_gfx1100.hsaco").write_bytes(b"not a code object")
    with pytest.raises(artifacts.ArtifactError, match="rebuild makes it again"):
        artifacts.amd_artifact("gfx1100").read_verified()

    (folder / "manifest.json").write_text("{")
    artifact = artifacts.amd_artifact("gfx1100")
    assert not artifact.local and artifact.read_verified()  # the prebuilt one serves
    assert any("ignoring the local kernel builds" in r.getMessage() and r.levelno == logging.WARNING
               for r in log_records.records)


def test_verify_prebuilt_names_each_problem(prebuilt_copy):
    assert artifacts.verify_prebuilt() == (list(build_facts.PREBUILT_TARGETS), [])
    (prebuilt_copy / "rdna_fa_gfx1102.hsaco").write_bytes(b"x")
    (prebuilt_copy / "rdna_fa_gfx1200.hsaco").unlink()
    verified, problems = artifacts.verify_prebuilt()
    assert "gfx1102" not in verified and "gfx1200" not in verified
    assert len(verified) == len(build_facts.PREBUILT_TARGETS) - 2
    assert problems[0].startswith("gfx1102: rdna_fa_gfx1102.hsaco does not match the sha256")
    assert problems[1] == "gfx1200: rdna_fa_gfx1200.hsaco is missing"
