"""The documentation site as a reader sees it: each page loaded in headless Chromium, after its scripts ran.

The strict build (test_site.py) checks links; this checks what only a browser shows: a mermaid diagram drawn, not
left as its `flowchart LR` source (the theme draws it with the mermaid build `make docs` puts beside the pages),
and every image on a page there to load. Chromium is Debian's package (`make browser`); the test skips without it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

ROOT = Path(__file__).parents[2]
MERMAID_JS = ROOT / "docs" / "assets" / "javascripts" / "mermaid.min.js"
DIAGRAM_PAGES = sorted(p for p in (ROOT / "docs").rglob("*.md") if "```mermaid" in p.read_text())
IMAGE_PAGES = sorted(p for p in (ROOT / "docs").rglob("*.md") if re.search(r"!\[[^\]]*\]\(", p.read_text()))


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    pytest.skip("no Chromium: `make browser` installs Debian's package (root on Debian/Ubuntu)")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("material", reason="mkdocs-material (the dev extra) builds the site")
    if not MERMAID_JS.exists():
        pytest.skip("no local mermaid build: `make mermaid` fetches it (needs npm)")
    out = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    return out


def built(site: Path, page: Path) -> Path:
    """The HTML file a docs page is built into."""
    relative = page.relative_to(ROOT / "docs").with_suffix("")
    return site / (relative.parent if relative.name == "index" else relative) / "index.html"


def rendered(site: Path, page: Path) -> str:
    """The page's DOM once its scripts ran, as Chromium holds it."""
    html = built(site, page)
    flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=15000", "--dump-dom"]
    result = subprocess.run(
        [chromium(), *flags, html.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and "</html>" in result.stdout, result.stderr[-2000:]
    return result.stdout


def test_the_pages_have_diagrams_and_images_to_look_at():
    assert DIAGRAM_PAGES and IMAGE_PAGES


@pytest.mark.parametrize("page", DIAGRAM_PAGES, ids=[p.stem for p in DIAGRAM_PAGES])
def test_every_mermaid_diagram_is_drawn(site: Path, page: Path):
    fences = page.read_text().count("```mermaid")
    dom = rendered(site, page)
    # The theme replaces each `<pre class="mermaid">` source with a `<div class="mermaid">` holding the drawing
    # (in a shadow root); a diagram it could not draw keeps its source on the page.
    assert '<pre class="mermaid"' not in dom and "flowchart LR" not in dom, f"{page.name}: a diagram is raw source"
    assert dom.count('<div class="mermaid">') == fences, f"{page.name}: {fences} diagram(s) expected"


@pytest.mark.parametrize("page", IMAGE_PAGES, ids=[p.stem for p in IMAGE_PAGES])
def test_every_image_on_a_page_is_there_to_load(site: Path, page: Path):
    dom = rendered(site, page)
    sources = re.findall(r'<img[^>]* src="([^"]+)"', dom)
    assert sources, f"{page.name}: no image rendered"
    for source in sources:
        url = urlparse(source)
        if url.scheme == "data":
            continue
        assert not url.scheme and not url.netloc, f"{page.name}: {source} is fetched from elsewhere"
        target = (built(site, page).parent / unquote(url.path)).resolve()
        assert target.is_file() and target.stat().st_size > 0, f"{page.name}: {source} is not in the site"
