"""The first-use self-test: its criterion, its cache and its verdicts."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import rdna_flash_attn as rfa
from rdna_flash_attn.config import settings
from rdna_flash_attn.dispatch import router as dispatch, selftest
from rdna_flash_attn.ops import autograd
from rdna_flash_attn.runtime import artifacts, device, loader

CPU = torch.device("cpu")


def _library():
    """The fake GPU's loaded library, described once, as the dispatcher hands both to the self-test."""
    return loader.loaded_library(device.describe(CPU))


def test_correct_kernels_pass_forward_and_backward(untested_fake_gpu):
    record = selftest.run(CPU, _library())
    assert record["passed"] and record["reason"] is None
    runs = len(selftest.CASES) * len(selftest.DTYPES)
    assert len(untested_fake_gpu.launches) == untested_fake_gpu.differentiable_launches == runs
    kinds = {" ".join(c["name"].split()[:2]) for c in record["checks"]}
    assert kinds == {"forward out", "forward lse", "backward dq", "backward dk", "backward dv"}
    assert any("bfloat16" in c["name"] for c in record["checks"])
    assert all(c["passed"] and c["error"] <= c["tolerance"] for c in record["checks"])


def test_a_first_call_under_inference_mode_still_checks_the_gradients(untested_fake_gpu):
    # ComfyUI runs every node under torch.inference_mode: the first kernel call, and so the self-test, too
    with torch.inference_mode():
        rfa.scaled_dot_product_attention(*(torch.randn(1, 2, 64, 64, dtype=torch.float16) for _ in range(3)))
        record = selftest.cached(_library())
    assert record["passed"], record["reason"]
    assert untested_fake_gpu.differentiable_launches == len(selftest.CASES) * len(selftest.DTYPES)
    assert rfa.stats()["kernel"] == 1


@pytest.mark.parametrize("error", [0.05, float("nan")])
def test_wrong_kernels_fail(untested_fake_gpu, error):
    untested_fake_gpu.error = error
    record = selftest.run(CPU, _library())
    assert not record["passed"] and record["reason"].startswith("self-test failed: forward out")


def test_a_wrong_backward_fails(untested_fake_gpu, monkeypatch):
    real = untested_fake_gpu.flash_attention

    def wrong_gradients(q, k, v, is_causal, scale):
        out = real(q, k, v, is_causal, scale)
        return out.detach() + 1.1 * (out - out.detach())  # right values, gradients 10% off

    monkeypatch.setattr(autograd, "flash_attention", wrong_gradients)
    record = selftest.run(CPU, _library())
    assert not record["passed"] and "backward" in record["reason"]


def test_a_kernel_that_raises_fails_without_crashing(untested_fake_gpu):
    untested_fake_gpu.raises = OSError("hipErrorNoBinaryForGpu")
    record = selftest.run(CPU, _library())
    assert not record["passed"] and "hipErrorNoBinaryForGpu" in record["reason"]


def test_the_verdict_is_cached_on_disk(untested_fake_gpu):
    assert selftest.verdict(CPU, _library()) is None
    runs = len(untested_fake_gpu.launches)
    assert selftest.verdict(CPU, _library()) is None
    dispatch.forget_devices()  # as a new process would start
    assert selftest.verdict(CPU, _library()) is None
    assert len(untested_fake_gpu.launches) == runs
    (entry,) = json.loads((Path(settings.cache_dir) / "selftest.json").read_text()).values()
    assert entry["key"] == {
        "artifact_sha256": "ab" * 32,
        "torch": torch.__version__,
        "runtime": "6.2.41512",
        "device": "AMD Radeon RX 7900 XTX [ZLUDA]",
        "revision": selftest.REVISION,
    }


@pytest.mark.parametrize(
    "change",
    [
        lambda gpu, mp: mp.setattr(gpu.devices, "sha256", "cd" * 32),
        lambda gpu, mp: mp.setattr(torch, "__version__", "2.99.0"),
        lambda gpu, mp: gpu.devices.info.update(runtime_version="7.0.0"),
        lambda gpu, mp: gpu.devices.info.update(name="AMD Radeon RX 7800 XT [ZLUDA]"),
        lambda gpu, mp: mp.setattr(selftest, "REVISION", selftest.REVISION + 1),
    ],
    ids=["artifact", "torch", "runtime", "device", "revision"],
)
def test_a_new_setup_is_tested_again(untested_fake_gpu, monkeypatch, change):
    selftest.verdict(CPU, _library())
    runs = len(untested_fake_gpu.launches)
    change(untested_fake_gpu, monkeypatch)
    selftest.verdict(CPU, _library())
    assert len(untested_fake_gpu.launches) == 2 * runs
    assert len(json.loads((Path(settings.cache_dir) / "selftest.json").read_text())) == 2


def test_a_cached_failure_stays_a_failure_and_is_said_once_per_process(untested_fake_gpu, log_records):
    untested_fake_gpu.error = 1.0
    reason = selftest.verdict(CPU, _library())
    untested_fake_gpu.error = 0.0  # the cache, not a new run, answers next
    assert selftest.verdict(CPU, _library()) == reason
    warnings = [r for r in log_records.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2  # one per verdict; the dispatcher asks once per device and process
    q = torch.randn(1, 2, 8, 64, dtype=torch.float16)
    for _ in range(3):
        rfa.scaled_dot_product_attention(q, q, q)
    assert len([r for r in log_records.records if r.levelno == logging.WARNING]) == 3
    assert rfa.stats()["fallback_reasons"] == {reason: 3}


def test_a_corrupt_cache_is_ignored(untested_fake_gpu):
    cache = Path(settings.cache_dir)
    cache.mkdir(parents=True)
    (cache / "selftest.json").write_text("{not json")
    assert selftest.verdict(CPU, _library()) is None
    assert json.loads((cache / "selftest.json").read_text())


def test_an_unwritable_cache_still_gives_a_verdict(untested_fake_gpu, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    settings.cache_dir = str(blocker / "cache")  # a folder inside a file cannot be made
    assert selftest.verdict(CPU, _library()) is None


def test_no_code_object_is_a_verdict_not_an_error(untested_fake_gpu, monkeypatch):
    def missing(info):
        raise loader.KernelUnavailable("no code object for gfx1100")

    monkeypatch.setattr(loader, "loaded_library", missing)
    assert dispatch.selftest_refusal(CPU) == "no code object for gfx1100"
    assert untested_fake_gpu.launches == []  # no self-test ran
    assert not (Path(settings.cache_dir) / selftest.CACHE_FILE_NAME).exists()


def test_a_first_call_describes_the_device_and_loads_its_code_object_once(untested_fake_gpu):
    # The description travels with the loaded library down to the self-test's cache key.
    q = torch.randn(1, 2, 8, 64, dtype=torch.float16)
    rfa.scaled_dot_product_attention(q, q, q)
    assert untested_fake_gpu.devices.loads == 1
    described = untested_fake_gpu.devices.calls
    rfa.scaled_dot_product_attention(q, q, q)
    assert untested_fake_gpu.devices.calls == described and untested_fake_gpu.devices.loads == 1


@pytest.mark.parametrize(
    "windows, env, expected",
    [
        (False, {"XDG_CACHE_HOME": "/xdg"}, "/xdg/rdna_flash_attn"),
        (False, {}, str(Path.home() / ".cache" / "rdna_flash_attn")),
        (True, {"LOCALAPPDATA": "/appdata"}, "/appdata/rdna_flash_attn"),
    ],
)
def test_default_cache_folder(monkeypatch, windows, env, expected):
    settings.cache_dir = None
    for name in ("XDG_CACHE_HOME", "LOCALAPPDATA"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(artifacts, "ON_WINDOWS", windows)
    assert str(selftest.cache_dir()) == expected
