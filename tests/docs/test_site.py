"""The documentation site builds in strict mode: a broken link, anchor or nav entry fails it (as `make docs`)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]


def test_site_builds_strictly(tmp_path: Path):
    pytest.importorskip("material", reason="mkdocs-material (the dev extra) builds the site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "reference" / "spec" / "index.html").exists()
