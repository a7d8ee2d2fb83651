"""The README stays short, and every relative link in it resolves to a file of the repository."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MAX_README_LINES = 150


def _github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(markdown: Path) -> set[str]:
    headings = re.findall(r"^#+ (.+)$", markdown.read_text(encoding="utf-8"), re.MULTILINE)
    return {_github_anchor(heading) for heading in headings}


def _relative_links(text: str) -> list[str]:
    return [target for target in LINK.findall(text) if not re.match(r"^[a-z]+:", target)]


def test_every_relative_link_of_the_readme_resolves():
    links = _relative_links(README.read_text(encoding="utf-8"))
    assert links, "the README links into the docs"
    broken = []
    for link in links:
        path, _, anchor = link.partition("#")
        target = (ROOT / path) if path else README
        if not target.exists() or (anchor and target.suffix == ".md" and anchor not in _anchors(target)):
            broken.append(link)
    assert not broken, f"README.md links that resolve to nothing: {broken}"


def test_the_readme_is_short():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines: move details into docs/"


def test_anchors_are_read_like_github():
    assert _github_anchor("Set-up: two commands") == "set-up-two-commands"
    assert "scale-suspend-resume" in _anchors(ROOT / "docs" / "guides" / "cluster.md")
