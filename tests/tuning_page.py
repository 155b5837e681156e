"""docs/tuning.md's tables, generated from the tuning table: `python -m tests.tuning_page --write`
rewrites them, tests/build/test_tuning_table.py fails while the page differs."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from rdna_flash_attn.runtime import tuning

PAGE = Path(__file__).resolve().parent.parent / "docs" / "tuning.md"
START = "<!-- tuning tables: python -m tests.tuning_page --write -->"
END = "<!-- end of the tuning tables -->"
KERNEL_TITLES = {"fwd": "Forward", "dkdv": "Backward, dK/dV", "dq": "Backward, dQ", "fwd8": "8-bit forward"}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _where(override: tuning.Override) -> str:
    parts = [override.isa or "every ISA"]
    if override.dtype:
        parts.append(override.dtype)
    if override.d_pad:
        parts.append("d" + ", d".join(str(d) for d in override.d_pad))
    if override.masked is not None:
        parts.append("masked" if override.masked else "unmasked")
    return " ".join(parts)


def tables() -> str:
    lines = []
    for kernel, knobs in tuning.KNOBS.items():
        lines += [f"### {KERNEL_TITLES[kernel]}", "", "| choice | rule |", "|---|---|"]
        lines += [f"| `{knob.name}` | {_cell(knob.why)} |" for knob in knobs]
        overrides = [o for o in tuning.OVERRIDES if o.kernel == kernel]
        if overrides:
            lines += ["", "| where | set | why |", "|---|---|---|"]
            lines += [f"| {_where(o)} | " + ", ".join(f"`{k}` = {v}" for k, v in o.values.items())
                      + f" | {_cell(o.why)} |" for o in overrides]
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def page_tables(page: str) -> str:
    match = re.search(re.escape(START) + r"\n(.*?)" + re.escape(END), page, re.S)
    return match.group(1) if match else ""


def write() -> None:
    page = PAGE.read_text(encoding="utf-8")
    start, end = page.index(START) + len(START) + 1, page.index(END)
    PAGE.write_text(page[:start] + tables() + page[end:], encoding="utf-8")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="rewrite the tables in docs/tuning.md")
    if parser.parse_args().write:
        write()
    else:
        print(tables(), end="")
