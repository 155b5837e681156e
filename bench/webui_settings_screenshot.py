"""Headless-browser check of the WebUI extension's settings: serves the gradio page built from the
extension's own settings components (extension/settings_page.py), opens it in headless Chromium
through the DevTools protocol, clicks the "training" checkbox with real mouse events, checks that the
dispatcher's setting (rdna_flash_attn.settings.training) followed, and saves a screenshot.

    python -m bench.webui_settings_screenshot --out bench/results/webui_settings.png

Needs gradio, websocket-client and a Chromium binary (Debian: apt-get install chromium).
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import rdna_flash_attn

ROOT = Path(__file__).resolve().parent.parent

TOGGLED_KEY = "rdna_fa_training"
BROWSER_NAMES = ("chromium", "chromium-browser", "google-chrome")


def find_browser() -> str | None:
    explicit = os.environ.get("CHROMIUM")
    return explicit or next((path for path in map(shutil.which, BROWSER_NAMES) if path), None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DevTools:
    """A minimal Chrome DevTools Protocol client over one page's websocket."""

    def __init__(self, websocket_url: str):
        import websocket

        self.socket = websocket.create_connection(websocket_url, timeout=30, suppress_origin=True)
        self.ids = itertools.count(1)

    def call(self, method: str, **params):
        message_id = next(self.ids)
        self.socket.send(json.dumps({"id": message_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.socket.recv())
            if reply.get("id") == message_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def evaluate(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.1)
        raise TimeoutError(f"page never satisfied: {expression}")

    def click(self, x: float, y: float) -> None:
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def close(self) -> None:
        self.socket.close()


def start_browser(browser: str, profile: str) -> tuple[subprocess.Popen, str]:
    """Headless Chromium on about:blank; returns the process and its page's websocket URL."""
    import urllib.request

    process = subprocess.Popen(
        [browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--remote-debugging-port=0", f"--user-data-dir={profile}",
         "--window-size=820,560", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    deadline = time.monotonic() + 30
    port = None
    while port is None and time.monotonic() < deadline:
        line = process.stderr.readline()
        match = re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line)
        if match:
            port = int(match.group(1))
        elif not line and process.poll() is not None:
            break
    if port is None:
        process.kill()
        raise RuntimeError("Chromium did not open its DevTools port")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as response:
        pages = [t for t in json.load(response) if t.get("type") == "page"]
    return process, pages[0]["webSocketDebuggerUrl"]


def run_check(out: Path, browser: str | None = None) -> dict:
    """Serve the page, toggle the checkbox in the browser, save the screenshot; returns what was seen."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # read when gradio is imported, just below
    from extension import options, settings_page

    browser = browser or find_browser()
    if browser is None:
        raise RuntimeError("no Chromium found (apt-get install chromium, or set CHROMIUM)")
    page = settings_page.build()
    port = free_port()
    page.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True, share=False)
    profile = tempfile.mkdtemp(prefix="rdna_fa_chromium_")
    process = None
    try:
        process, websocket_url = start_browser(browser, profile)
        tools = DevTools(websocket_url)
        tools.call("Page.navigate", url=f"http://127.0.0.1:{port}/")
        selector = f"#setting_{TOGGLED_KEY} input[type=checkbox]"
        tools.wait_for(f"document.querySelector({selector!r}) !== null")
        before = rdna_flash_attn.settings.training
        rect = tools.evaluate(
            f"(() => {{ const r = document.querySelector({selector!r}).getBoundingClientRect();"
            " return {x: r.x + r.width / 2, y: r.y + r.height / 2}; })()"
        )
        tools.click(rect["x"], rect["y"])
        deadline = time.monotonic() + 15
        while rdna_flash_attn.settings.training == before and time.monotonic() < deadline:
            time.sleep(0.05)
        after = rdna_flash_attn.settings.training
        checked = tools.evaluate(f"document.querySelector({selector!r}).checked")
        shot = tools.call("Page.captureScreenshot", format="png")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(base64.b64decode(shot["data"]))
        tools.close()
        return {"setting": TOGGLED_KEY, "before": before, "after": after, "checked_in_page": checked,
                "labels": [option.label for option in options.OPTIONS], "screenshot": str(out)}
    finally:
        if process is not None:
            process.kill()
            process.wait()
        page.close()
        shutil.rmtree(profile, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "webui_settings.png")
    args = parser.parse_args()
    result = run_check(args.out)
    print(json.dumps(result, indent=2))
    if result["after"] == result["before"]:
        sys.exit("the checkbox click did not change the dispatcher's setting")


if __name__ == "__main__":
    main()
