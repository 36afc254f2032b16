"""The README is a short user guide, the docs pages link to files that exist, and no session numbers remain.

Links are checked as GitHub renders them: a relative target (not http, mailto or a bare #anchor) resolved
against the page's folder must exist; an anchor into a markdown page must be one of its headings' slugs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))  # code blocks hold commands, not links
    text = re.sub(r"`[^`\n]*`", "", text)  # nor do inline code spans
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def _slugs(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped (not - or _), spaces to -, repeats -1, -2."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_readme_is_a_user_guide_of_at_most_260_lines():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= 260, f"README.md has {n} lines: move details to a page under docs/"


def test_the_readme_gives_the_test_command_that_ci_runs():
    readme = README.read_text(encoding="utf-8")
    assert re.search(r"^make demo\b", readme, re.M) and re.search(r"^make test\b", readme, re.M)
    assert re.search(r"^make test$", (ROOT / ".ci" / "run").read_text(), re.M)
    assert re.search(r"^test:", (ROOT / "Makefile").read_text(), re.M)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_an_existing_file(page: Path):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _slugs(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_docs_link_checker_catches_a_broken_link(tmp_path):
    page = tmp_path / "p.md"
    (tmp_path / "q.md").write_text("# A title (`x`, y)\n")
    page.write_text("[ok](q.md#a-title-x-y) [gone](missing.md) [web](https://example.com) `[code](nope.md)`\n")
    assert _links(page) == ["q.md#a-title-x-y", "missing.md"]
    assert _slugs(tmp_path / "q.md") == {"a-title-x-y"}
    assert not (tmp_path / "missing.md").exists()


def test_no_session_numbers_in_the_tree():
    """Docs, code, comments, tests, benchmarks and scripts say when (a date), never which session."""
    pattern = re.compile(r"\bsession[ -]?\d|\(session\s+\d|\bsession-\d", re.I)
    files = [README, ROOT / "Makefile", *PAGES]
    for folder in ("retrace", "tests", "benchmarks", "scripts"):
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md", ".sh", ".toml")]
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in set(files) for i, line in
            enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1) if pattern.search(line)]
    assert not hits, "session numbers at " + ", ".join(sorted(hits))
