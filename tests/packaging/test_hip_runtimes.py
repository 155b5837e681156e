"""Which code object a HIP runtime gets: version 4 first for HIP 5.x, version 5 first for HIP 6.0 and
newer, the other version when the first is refused, and PyTorch SDPA with one clear reason when every
version is refused. The HIP runtime is a fake that reports a version and refuses code objects by the
version in their ELF header; the code objects are the real prebuilt ones."""

from __future__ import annotations

import pytest
import torch

from rdna_flash_attn.runtime import artifacts, build_facts, codeobject, loader as runtime
from rdna_flash_attn.dispatch import router
from rdna_flash_attn.tools import cli
from rdna_flash_attn.ops import attention as ops

from .conftest import REPO_PREBUILT, code_object_version_of, fallback_reason_of_one_call

GPU = torch.device("cuda", 0)
# hipRuntimeGetVersion of real releases, as driver.HipDriver.runtime_version formats them
HIP_5_7 = "5.7.31921"
HIP_6_2 = "6.2.41512"
HIP_6_4 = "6.4.43482"
HIP_7_1 = "7.1.25424"


@pytest.mark.parametrize("runtime_version, preference", [
    (HIP_5_7, (4, 5)),
    ("5.5.30201", (4, 5)),
    ("6.0.32830", (5, 4)),
    (HIP_6_2, (5, 4)),
    (HIP_6_4, (5, 4)),
    (HIP_7_1, (5, 4)),
    ("10.0.0", (5, 4)),
    (None, (5, 4)),
    ("unknown", (5, 4)),
])
def test_code_object_preference_follows_the_runtime_version(runtime_version, preference):
    assert runtime.code_object_preference(runtime_version) == preference


@pytest.mark.parametrize("runtime_version, expected_version", [
    (HIP_5_7, 4), (HIP_6_2, 5), (HIP_6_4, 5), (HIP_7_1, 5),
])
def test_each_runtime_loads_the_code_object_of_its_preferred_version(amd_gpu, runtime_version, expected_version):
    amd_gpu.hip.version = runtime_version
    assert runtime.loaded_library_for(GPU).artifact.target == "gfx1100"
    (loaded,) = amd_gpu.hip.loaded
    assert code_object_version_of(loaded) == expected_version
    assert loaded == (REPO_PREBUILT / build_facts.artifact_name("gfx1100", expected_version)).read_bytes()
    info = ops.artifact_info(GPU)
    assert info["code_object_version"] == expected_version and info["runtime_version"] == runtime_version


@pytest.mark.parametrize("target", build_facts.PREBUILT_TARGETS)
def test_a_target_without_a_v4_code_object_gets_v5_on_hip_5(amd_gpu, target):
    amd_gpu.target, amd_gpu.hip.version = target, HIP_5_7
    assert runtime.loaded_library_for(GPU).artifact.target == target
    expected = 4 if target in build_facts.LEGACY_TARGETS else 5
    assert [code_object_version_of(data) for data in amd_gpu.hip.loaded] == [expected]


def test_a_refused_v5_falls_back_to_v4_with_one_log_line(amd_gpu, log_records):
    amd_gpu.hip.version, amd_gpu.hip.refuses = HIP_6_2, {5}
    assert runtime.loaded_library_for(GPU).artifact.target == "gfx1100"
    assert [code_object_version_of(data) for data in amd_gpu.hip.loaded] == [4]
    (line,) = [r.getMessage() for r in log_records.records if "refused" in r.getMessage()]
    assert line.startswith(f"RDNA Flash Attention: HIP runtime {HIP_6_2} refused code object v5 for gfx1100 "
                           "(hipModuleLoadData failed")
    assert line.endswith("; trying the next version")


def test_a_runtime_that_refuses_every_version_gives_sdpa_and_one_clear_reason(amd_gpu):
    amd_gpu.hip.version, amd_gpu.hip.refuses = HIP_5_7, {4, 5}
    reason = fallback_reason_of_one_call()
    assert reason.startswith(f"the HIP runtime {HIP_5_7} refused the code objects for gfx1100: "
                             "v4 (rdna_fa_gfx1100.cov4.hsaco): hipModuleLoadData failed: ")
    assert "; v5 (rdna_fa_gfx1100.hsaco): hipModuleLoadData failed: " in reason
    assert amd_gpu.hip.loaded == []


def test_a_runtime_older_than_the_target_is_named_in_the_reason(amd_gpu):
    amd_gpu.target, amd_gpu.hip.version, amd_gpu.hip.refuses = "gfx1201", "6.1.40093", {4, 5}
    reason = fallback_reason_of_one_call()
    assert reason.startswith("the HIP runtime 6.1.40093 refused the code objects for gfx1201: v5 (rdna_fa_gfx1201.hsaco)")
    assert reason.endswith("(HIP 6.2 is the first runtime that knows gfx1201: update the HIP SDK/ROCm)")


def test_a_damaged_code_object_is_not_retried_in_the_other_version(prebuilt_copy, amd_gpu):
    amd_gpu.hip.version = HIP_5_7
    (prebuilt_copy / "rdna_fa_gfx1100.cov4.hsaco").write_bytes(b"x")
    reason = fallback_reason_of_one_call()
    assert "rdna_fa_gfx1100.cov4.hsaco does not match the sha256" in reason and "reinstall" in reason
    assert amd_gpu.hip.loaded == []


def test_every_prebuilt_code_object_is_the_version_its_manifest_says_and_reads_no_hidden_argument():
    """The launcher passes only the explicit argument block: a kernel reading an implicit argument would
    depend on the runtime filling it, at offsets that differ between v4 and v5."""
    manifest = artifacts.load_manifest(REPO_PREBUILT)
    listed = [(target, version) for target, version, _ in build_facts.listed_code_objects(manifest)]
    assert sorted(target for target, version in listed if version == 4) == sorted(build_facts.LEGACY_TARGETS)
    assert sorted(target for target, version in listed if version == 5) == sorted(build_facts.PREBUILT_TARGETS)
    kernarg_sizes = {}
    for target, version in listed:
        entry = manifest[build_facts.manifest_table(version)][target]
        code_object = codeobject.load_code_object(REPO_PREBUILT / entry["file"])
        assert code_object.code_object_version == version == entry["code_object_version"]
        assert code_object.target == target
        assert all(kernel.hidden_args == () for kernel in code_object.kernels)
        kernarg_sizes[target, version] = {k.name: k.kernarg_bytes for k in code_object.kernels}
    for target in build_facts.LEGACY_TARGETS:
        assert kernarg_sizes[target, 4] == kernarg_sizes[target, 5]


def test_doctor_names_the_runtime_and_the_code_object_version(amd_gpu, monkeypatch, capsys):
    amd_gpu.hip.version = HIP_5_7
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(runtime.devices, "describe", lambda dev: runtime.devices.DeviceInfo(
        "zluda", "AMD Radeon RX 7900 XTX [ZLUDA]", 0, "gfx1100", HIP_5_7))
    monkeypatch.setattr(router, "selftest_refusal", lambda device: None)
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert f"code object v4 loaded by HIP runtime {HIP_5_7} (order tried: v4, v5)" in " ".join(out.split())
    assert "code object v4 gfx1100, gfx1101, gfx1102, gfx1103" in " ".join(out.split())
    assert "rdna_fa_gfx1100.cov4.hsaco" in out
