"""Every test under tests/reliability is marked `reliability` (and `integration`)."""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.reliability)
            item.add_marker(pytest.mark.integration)
