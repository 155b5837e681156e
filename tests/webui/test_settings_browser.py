"""A real browser: the gradio page built from the extension's settings components renders in
headless Chromium, and clicking a checkbox there changes the dispatcher's setting."""

from __future__ import annotations

import pytest

import rdna_flash_attn
from bench import webui_settings_screenshot as script


def test_clicking_the_training_checkbox_in_chromium_changes_the_setting(tmp_path):
    pytest.importorskip("gradio", reason="gradio not installed")
    pytest.importorskip("websocket", reason="websocket-client not installed")
    if script.find_browser() is None:
        pytest.skip("no Chromium (apt-get install chromium)")
    assert rdna_flash_attn.settings.training is True
    result = script.run_check(tmp_path / "settings.png")
    assert (result["before"], result["after"], result["checked_in_page"]) == (True, False, False)
    assert rdna_flash_attn.settings.training is False
    png = (tmp_path / "settings.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5000
