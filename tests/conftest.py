import functools
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


SLOW_TEST_TIMEOUT_S = 900
"""End-to-end runs (`@pytest.mark.slow`) train for real on a shared 2-core machine: a longer limit than
the global `timeout` in pyproject.toml, unless the test sets its own `@pytest.mark.timeout`."""


@functools.cache
def _cuda_missing() -> str | None:
    """Why `cuda` tests cannot run here, or None when a CUDA device is there."""
    import torch  # here, not at module level: most of the suite never needs it

    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU (CUDA): `make gpu-check` runs it on a GPU machine"
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("slow") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SLOW_TEST_TIMEOUT_S))
        if item.get_closest_marker("cuda") is not None:
            reason = _cuda_missing()
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def repo() -> Path:
    return REPO
