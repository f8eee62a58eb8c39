"""Every relative link in the README and the docs leads somewhere (issue 20).

Checks the links ``[text](target)`` of README.md, docs/*.md, deploy/README.md and
benchmarks/README.md: a relative target must be a file or folder of the repository, and a
``#anchor`` into a Markdown file must name one of its headings (GitHub's slugs). Web links
are not fetched.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "deploy" / "README.md",
         ROOT / "benchmarks" / "README.md"]

_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text())
    found: set[str] = set()
    for line in text.splitlines():
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            s = slug(m.group(1))
            n = 1
            base = s
            while s in found:  # GitHub numbers repeated headings
                s, n = f"{base}-{n}", n + 1
            found.add(s)
    return found


def links(page: Path) -> list[str]:
    return _LINK.findall(_FENCE.sub("", page.read_text()))


def test_the_pages_exist() -> None:
    for name in ("architecture", "configuration", "operations", "benchmarks"):
        assert (ROOT / "docs" / f"{name}.md").is_file(), f"docs/{name}.md is missing"
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150, "README.md is the newcomer's page: keep it under 150 lines"
    for page in (ROOT / "docs").glob("*.md"):
        assert f"docs/{page.name}" in readme, f"README.md does not link docs/{page.name}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"broken links in {page.relative_to(ROOT)}:\n" + "\n".join(f"  {b}" for b in broken)
