"""Settings: environment variables, the same as Python attributes, and the logger level."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

import rdna_flash_attn as rfa
from rdna_flash_attn import environment
from rdna_flash_attn.config import LOGGER_NAME, Settings, settings
from rdna_flash_attn.runtime import loader

ENV_VARS = {"RDNA_FA_DISABLE", "RDNA_FA_FORCE", "RDNA_FA_TRAINING", "RDNA_FA_FP32_CAST", "RDNA_FA_PRECISION",
            "RDNA_FA_LOG_LEVEL", "RDNA_FA_CACHE_DIR", "RDNA_FA_ATEN_OPS"}


def test_defaults():
    assert Settings.from_env({}) == Settings(
        disable=False, force=False, training=True, fp32_cast="off", precision="exact", log_level=None, cache_dir=None,
        aten_ops=False,
    )


def test_every_setting_has_a_variable_and_a_one_line_doc():
    options = Settings.options()
    assert {env for _, env, _, _ in options} == ENV_VARS
    for name, _env, default, doc in options:
        assert getattr(Settings(), name) == default
        assert doc and "\n" not in doc


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"RDNA_FA_DISABLE": "1"}, {"disable": True}),
        ({"RDNA_FA_DISABLE": "true"}, {"disable": True}),
        ({"RDNA_FA_FORCE": "yes"}, {"force": True}),
        ({"RDNA_FA_FORCE": "0"}, {"force": False}),
        ({"RDNA_FA_TRAINING": "0"}, {"training": False}),
        ({"RDNA_FA_TRAINING": "off"}, {"training": False}),
        ({"RDNA_FA_FP32_CAST": "bf16"}, {"fp32_cast": "bf16"}),
        ({"RDNA_FA_FP32_CAST": " FP16 "}, {"fp32_cast": "fp16"}),
        ({"RDNA_FA_LOG_LEVEL": "debug"}, {"log_level": "DEBUG"}),
        ({"RDNA_FA_LOG_LEVEL": "20"}, {"log_level": "20"}),
        ({"RDNA_FA_CACHE_DIR": "/tmp/x"}, {"cache_dir": "/tmp/x"}),
        ({"RDNA_FA_DISABLE": ""}, {"disable": False}),  # empty means unset
    ],
)
def test_environment_variables(env, expected):
    loaded = Settings.from_env(env)
    for name, value in expected.items():
        assert getattr(loaded, name) == value


@pytest.mark.parametrize(
    "env", [{"RDNA_FA_DISABLE": "maybe"}, {"RDNA_FA_FP32_CAST": "int8"}, {"RDNA_FA_LOG_LEVEL": "LOUD"}]
)
def test_malformed_variables_are_logged_and_ignored(env, log_records):
    assert Settings.from_env(env) == Settings()
    (record,) = log_records.records
    assert record.levelno == logging.WARNING and next(iter(env)) in record.getMessage()


@pytest.mark.parametrize("env, used", [({"RDNA_FA_TRAINING": "maybe"}, "using 1 instead"),
                                       ({"RDNA_FA_DISABLE": "2"}, "using 0 instead"),
                                       ({"RDNA_FA_FP32_CAST": "fp8"}, "using off instead"),
                                       ({"RDNA_FA_LOG_LEVEL": "LOUD"}, "leaving it unset")])
def test_a_bad_value_is_one_warning_naming_it_and_the_value_used(env, used, log_records):
    ((variable, value),) = env.items()
    for _ in range(2):
        assert Settings.from_env(env) == Settings()
    (record,) = log_records.records
    assert f"{variable}={value!r}" in record.getMessage() and record.getMessage().endswith(used)


def test_every_boolean_variable_takes_the_same_words():
    for word, value in [("1", True), ("On", True), (" yes ", True), ("TRUE", True), ("0", False), ("off", False),
                        ("No", False), ("false", False)]:
        assert environment.read_bool({"RDNA_FA_PATCH_SDPA": word}, "RDNA_FA_PATCH_SDPA") is value
        assert Settings.from_env({"RDNA_FA_FORCE": word}).force is value


def test_the_emulated_layer_variable_is_read_the_same_way(monkeypatch, log_records):
    monkeypatch.setenv("RDNA_FA_EMULATE", " GFX12 ")
    assert loader.emulated_layer() == "gfx12"
    monkeypatch.setenv("RDNA_FA_EMULATE", "gfx9")
    assert loader.emulated_layer() == loader.emulated_layer() == "gfx11"
    (record,) = log_records.records
    assert "ignoring RDNA_FA_EMULATE='gfx9': expected gfx11 or gfx12; using gfx11 instead" in record.getMessage()


def test_an_unknown_setting_is_an_attribute_error_listing_the_settings():
    with pytest.raises(AttributeError, match=r"no setting 'nonexistent'; the settings are disable, force, training"):
        settings.nonexistent = 1


@pytest.mark.parametrize(
    "name, value, error",
    [("disable", "1", TypeError), ("force", 1, TypeError), ("training", None, TypeError),
     ("fp32_cast", "fp8", ValueError), ("log_level", "LOUD", ValueError)],
)
def test_attributes_are_validated_where_set(name, value, error):
    with pytest.raises(error):
        setattr(settings, name, value)


def test_attribute_changes_take_effect_at_once(fake_gpu):
    q = torch.randn(1, 2, 8, 64, dtype=torch.float16)
    rfa.scaled_dot_product_attention(q, q, q)
    rfa.settings.disable = True
    rfa.scaled_dot_product_attention(q, q, q)
    rfa.settings.disable = False
    rfa.settings.fp32_cast = "bf16"
    rfa.scaled_dot_product_attention(q.float(), q.float(), q.float())
    assert rfa.stats()["kernel"] == 2 and rfa.stats()["fallback"] == 1


def test_the_hot_path_never_reads_the_environment(fake_gpu, monkeypatch):
    class NoReads(dict):
        def __getitem__(self, key):
            raise AssertionError(f"environment read: {key}")

        get = __getitem__

    q = torch.randn(1, 2, 8, 64, dtype=torch.float16)
    rfa.scaled_dot_product_attention(q, q, q)  # first call: the device verdicts are made
    monkeypatch.setattr(os, "environ", NoReads())
    for kwargs in ({}, {"dropout_p": 0.5}):
        rfa.scaled_dot_product_attention(q, q, q, **kwargs)


def test_log_level_belongs_to_the_live_settings_only():
    logger = logging.getLogger(LOGGER_NAME)
    Settings(log_level="DEBUG")
    assert logger.level == logging.NOTSET
    settings.log_level = "debug"
    assert logger.level == logging.DEBUG
    settings.log_level = None
    assert logger.level == logging.NOTSET


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ENV_VARS} | env
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, check=True)


def test_variables_are_read_at_import():
    code = "import rdna_flash_attn as r; s = r.settings; print(s.disable, s.force, s.training, s.fp32_cast)"
    result = run_python(code, RDNA_FA_DISABLE="1", RDNA_FA_FORCE="1", RDNA_FA_TRAINING="0", RDNA_FA_FP32_CAST="bf16")
    assert result.stdout.split() == ["True", "True", "False", "bf16"]


def test_log_level_variable_shows_fallback_reasons_on_stderr_without_host_logging():
    code = "import torch, rdna_flash_attn as r; q = torch.randn(1, 1, 4, 8); r.scaled_dot_product_attention(q, q, q)"
    result = run_python(code, RDNA_FA_LOG_LEVEL="INFO")
    assert "not using the kernels: CPU tensors" in result.stderr and result.stdout == ""
    assert run_python(code).stderr == ""  # quiet by default
