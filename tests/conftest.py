from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


SLOW_TEST_TIMEOUT_S = 900
"""End-to-end runs (`@pytest.mark.slow`) train for real on a shared 2-core machine: a longer limit than
the global `timeout` in pyproject.toml, unless the test sets its own `@pytest.mark.timeout`."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TEST_TIMEOUT_S))


@pytest.fixture
def repo() -> Path:
    return REPO
