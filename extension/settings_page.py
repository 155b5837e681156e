"""A standalone gradio page of the extension's settings: the same components the WebUI's Settings
section shows (gr.Checkbox, elem_id "setting_<key>" as the WebUIs name them), each change applied
as the WebUI's onchange would. For a look without a WebUI, and for the browser test.
"""

from __future__ import annotations

import functools

from . import options


def _changed(key: str, value: bool) -> None:
    options.apply(key, bool(value))


def build():
    """The gr.Blocks page; needs gradio."""
    import gradio as gr

    checkbox = options.checkbox_component()
    with gr.Blocks(title=options.SECTION[1]) as page:
        gr.Markdown(f"## {options.SECTION[1]}")
        for option in options.OPTIONS:
            box = checkbox(value=options.current(option.key), label=option.label, elem_id=f"setting_{option.key}")
            box.change(functools.partial(_changed, option.key), inputs=box, outputs=None)
    return page
