"""Every relative link in README.md, docs/*.md and bench/results/README.md resolves: the file (or folder)
exists, and a #anchor names a heading of the Markdown page it points to (GitHub's heading ids)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "results" / "README.md"]

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"(`+).+?\1", re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """The page without fenced code blocks and code spans, whose brackets are not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's id for a heading: link text kept, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The heading ids of a page, with GitHub's -1, -2 ... for repeated headings."""
    seen: dict[str, int] = {}
    ids = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = slug(heading)
        count = seen.get(base, 0)
        ids.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return ids


def links(page: Path) -> list[str]:
    return LINK.findall(prose(page.read_text(encoding="utf-8")))


def broken(page: Path) -> list[str]:
    problems = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            problems.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            problems.append(f"{target}: no heading #{anchor} in {file.name}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_relative_links_resolve(page):
    assert page.exists()
    assert broken(page) == []


def test_the_pages_have_links():
    # A pattern that matched nothing would pass every page.
    assert len(links(REPO / "README.md")) > 10


def test_slugs_follow_github():
    assert slug("Troubleshooting: what doctor and install.py print") == \
        "troubleshooting-what-doctor-and-installpy-print"
    assert slug("diffusers / peft") == "diffusers--peft"
    assert slug("4. The shipped code objects on a CPU interpreter") == \
        "4-the-shipped-code-objects-on-a-cpu-interpreter"
    assert slug("flash-attn's own test suite") == "flash-attns-own-test-suite"
    assert slug("torch.compile") == "torchcompile"


def test_a_broken_link_and_anchor_are_found(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## Part one\n", encoding="utf-8")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#part-one) [gone](missing.md) [bad](a.md#part-two) [self](#nowhere) "
                    "`[code](missing.md)`\n\n```\n[fenced](missing.md)\n```\n# Here\n", encoding="utf-8")
    assert broken(page) == ["missing.md: no such file", "a.md#part-two: no heading #part-two in a.md",
                            "#nowhere: no heading #nowhere in b.md"]
