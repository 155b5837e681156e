"""GPU tests: skipped cleanly without CUDA or without the emulation builds (kernels/build.py --emulate)."""

import pytest
import torch

from rdna_flash_attn import artifacts, runtime

EMULATED_LAYERS = artifacts.EMULATED_LAYERS


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
