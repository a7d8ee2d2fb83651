from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


@pytest.fixture
def repo() -> Path:
    return REPO
