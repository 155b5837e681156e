"""GPU tests: skipped cleanly without CUDA or without the emulation builds (kernels/build.py --emulate)."""

import pytest
import torch

from rdna_flash_attn.runtime import artifacts, device, loader as runtime
from rdna_flash_attn.dispatch import router as dispatch
from rdna_flash_attn.config import Settings, settings

EMULATED_LAYERS = artifacts.EMULATED_LAYERS
GPU = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (kernels run through the NVIDIA emulation of gfx11/gfx12)")
    for item in items:
        if "tests/gpu/" in item.nodeid.replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture(params=EMULATED_LAYERS)
def emulated_layer(request, monkeypatch):
    """Runs the test once per emulated AMD layer."""
    layer = request.param
    try:
        artifacts.emulated_artifact(layer)
    except artifacts.ArtifactError as error:
        pytest.skip(str(error))
    monkeypatch.setenv("RDNA_FA_EMULATE", layer)
    assert runtime.emulated_layer() == layer
    return layer


@pytest.fixture(scope="session")
def selftest_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("selftest-cache"))


@pytest.fixture
def kernels_on(emulated_layer, selftest_cache):
    """The dispatcher routes this GPU's calls to the kernels (forced on NVIDIA, which needs
    RDNA_FA_FORCE=1 to run the emulation through the API), its self-test passed."""
    if device.describe(GPU).backend == "cuda" and not Settings.from_env().force:
        pytest.skip("NVIDIA GPU: set RDNA_FA_FORCE=1 to run the emulated kernels through the API")
    settings.force = True
    settings.cache_dir = selftest_cache
    dispatch.forget_devices()
    refusal = dispatch.device_refusal(GPU) or dispatch.selftest_refusal(GPU)  # the self-test, before counting
    assert refusal is None, refusal
    return GPU
