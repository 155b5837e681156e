"""The shipped code objects against the tuning table, instance by instance: each code object holds every
kernel the table makes for its target and nothing else, and each kernel fits the static limits (no scratch,
no spills, LDS within 64 KiB and wave32) with the LDS and workgroup size its traits give
(variant.lds_bytes(target), variant.threads). `python -m rdna_fa_lab report --check` prints the same
findings as a table.

What it cannot prove: a traits choice that leaves LDS and the workgroup size alone (held or re-read
operands, unrolls) shows only in the instructions; tests/bench/test_estimators.py reads those for the
instances the estimates price, and the GPU grids run every instance of the emulation build."""

from __future__ import annotations

import pytest

from rdna_fa_lab import resource_report
from rdna_flash_attn.runtime import artifacts, tuning, variants
from rdna_flash_attn.runtime.codeobject import load_code_object

MANIFEST = artifacts.prebuilt_dir() / "manifest.json"


def shipped() -> list[resource_report.Artifact]:
    return resource_report.artifacts_from_manifest(MANIFEST)


@pytest.mark.parametrize("artifact", shipped(), ids=lambda a: a.path.name)
def test_every_instance_of_the_table_is_built_within_its_limits(artifact):
    code_object = load_code_object(artifact.path)
    assert {kernel.name for kernel in code_object.kernels} == set(variants.target_symbols(code_object.target))
    rows = resource_report.collect_rows({artifact.path: code_object}, {artifact.path: None})
    problems = resource_report.artifact_problems(artifact, code_object)
    problems += [problem for row in rows for problem in resource_report.kernel_problems(row)]
    assert problems == []



def test_a_table_the_code_objects_were_not_built_from_is_found(monkeypatch):
    # Staging Q and dO takes LDS: a table that stages them where the build did not disagrees with the kernel.
    staged = tuning.Override("dq", {"staged_qdo": True}, "not built so", isa="gfx11", d_pad=(96,), masked=False)
    monkeypatch.setattr(tuning, "OVERRIDES", tuning.OVERRIDES + (staged,))
    gfx1100 = next(a for a in shipped() if a.expected_target == "gfx1100")
    code_object = load_code_object(gfx1100.path)
    rows = resource_report.collect_rows({gfx1100.path: code_object}, {gfx1100.path: None})
    problems = [problem for row in rows for problem in resource_report.kernel_problems(row)]
    assert len(problems) == 2 and all("host and kernel disagree" in p for p in problems)  # f16 and bf16
