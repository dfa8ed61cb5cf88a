"""Every relative link in README.md, docs/**/*.md and the deploy/ and engine_adapter/ READMEs
points at a file or folder that exists.

The docs move often (pages split, runs archived under docs/runs/); a link left pointing at
the old place is a dead end for a newcomer, so this fails with the page, the line and the
target. External links (http, mailto) and in-page anchors are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# [text](target) and ![alt](target); the target ends at whitespace or ')'.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
EXTERNAL = ("http://", "https://", "mailto:")


def markdown_pages() -> list[Path]:
    """README.md, the deploy/ and engine_adapter/ READMEs, and every Markdown page under docs/."""
    owned = [
        ROOT / "README.md",
        ROOT / "deploy" / "README.md",
        ROOT / "engine_adapter" / "README.md",
    ]
    return [*owned, *sorted((ROOT / "docs").rglob("*.md"))]


def broken_links(page: Path) -> list[str]:
    """'page:line: target' for each relative link of ``page`` whose file does not exist."""
    broken = []
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        for target in LINK.findall(line):
            if target.startswith(EXTERNAL) or target.startswith("#"):
                continue
            path = target.split("#", 1)[0]
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}:{number}: {target}")
    return broken


def test_relative_links_point_at_existing_files() -> None:
    broken = [entry for page in markdown_pages() for entry in broken_links(page)]
    assert not broken, "links to files that do not exist (moved or renamed?):\n" + "\n".join(broken)
