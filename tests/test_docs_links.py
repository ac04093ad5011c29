"""Every relative link in README.md and docs/**/*.md points to a file that exists, and a link
with a `#fragment` to a heading of that file (headings slugged as GitHub renders them). Fast: it
reads text only, no network."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^()\s]+)\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]: *(\S+)")
HEADING = re.compile(r"(#{1,6}) +(.+?) *#* *$")
EXTERNAL = ("http://", "https://", "mailto:")


def unfenced_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, no punctuation but '-' and '_', '-' for spaces."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    for line in unfenced_lines(path.read_text()):
        match = HEADING.match(line)
        if match:
            base = slug(match.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
    return {base if n == 0 else f"{base}-{n}" for base, count in seen.items() for n in range(count)}


def links(path: Path) -> list[str]:
    """Link targets outside code: fenced blocks and inline code spans are left out."""
    prose = [re.sub(r"`[^`]*`", "", line) for line in unfenced_lines(path.read_text())]
    inline = [target for line in prose for target in LINK.findall(line)]
    return inline + [m.group(1) for line in prose if (m := REFERENCE.match(line))]


def broken(path: Path) -> list[str]:
    """This page's relative links whose file or heading does not exist."""
    out = []
    for target in links(path):
        if target.startswith(EXTERNAL):
            continue
        file_part, _, fragment = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            out.append(f"{target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            out.append(f"{target} (no such heading)")
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert broken(page) == []


def test_the_checker_finds_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "b.md").write_text("# Title\n\n## A `flag`, twice\n\n## A `flag`, twice\n")
    page = tmp_path / "a.md"
    page.write_text(
        "[ok](b.md#a-flag-twice) [ok](b.md#a-flag-twice-1) [ok](#top) [web](https://x.y/z)\n"
        "`[code](nowhere.md)`\n```\n[fenced](nowhere.md)\n```\n"
        "[gone](missing.md) [bad](b.md#nothing) ![img](missing.png)\n# Top\n"
        "[by reference][r] [ok][s]\n\n[r]: gone.md#x\n[s]: b.md\n"
    )
    assert broken(page) == [
        "missing.md (no such file)",
        "b.md#nothing (no such heading)",
        "missing.png (no such file)",
        "gone.md#x (no such file)",
    ]


def test_every_page_is_found() -> None:
    names = {str(p.relative_to(ROOT)) for p in PAGES}
    assert {"README.md", "docs/architecture.md", "docs/benchmarks.md"} <= names
