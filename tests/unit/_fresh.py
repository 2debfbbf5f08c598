"""Run a snippet in a fresh interpreter: what another trainer process would compute."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any


def fresh_json(code: str) -> Any:
    """Run `code` in a new `python -W error` with another hash seed; parse what it prints.

    The snippet must print one JSON document. PYTHONHASHSEED differs from ours,
    so anything built on Python's salted `hash()` would come out different.
    """
    env = {**os.environ, "PYTHONHASHSEED": str(1 + int(os.environ.get("PYTHONHASHSEED", "0") or 0))}
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)
