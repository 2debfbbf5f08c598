"""The CPU-sensitive golden tests again, with numpy's SIMD kernels for AVX-512 / AVX2 off.

numpy picks the kernel of np.power, np.log1p, np.cos, ... by CPU at import time,
and those kernels are not correctly rounded: a value pinned on one machine may
differ on another. `NPY_DISABLE_CPU_FEATURES` makes numpy take the kernels that
a machine without those features takes, so the suite checks them on this one.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
# the Keras parity and pow tests (Adam's beta**t), the initializers' golden values
SELECTION = [
    "tests/unit/test_optimizers.py",
    "tests/unit/test_initializers.py",
    "-k",
    "matches_keras or beta_powers or golden",
]
_AVX512 = ("X86_V4", "AVX512_ICL", "AVX512_SPR", "AVX512F", "AVX512CD", "AVX512_SKX")
_AVX2 = ("X86_V3", "AVX2", "FMA3", "F16C", "AVX")


def _umath() -> Any:
    try:
        return importlib.import_module("numpy._core._multiarray_umath")
    except ImportError:  # numpy 1.x
        return importlib.import_module("numpy.core._multiarray_umath")


def _dispatched(names: tuple[str, ...]) -> list[str]:
    """Of names, the dispatch targets this numpy build would use on this CPU."""
    umath = _umath()
    features, dispatch = umath.__cpu_features__, umath.__cpu_dispatch__
    return [n for n in names if n in dispatch and features.get(n)]


@pytest.mark.parametrize("names", [_AVX512, _AVX512 + _AVX2], ids=["no-avx512", "no-avx2"])
def test_golden_values_with_simd_kernels_disabled(names: tuple[str, ...]) -> None:
    disabled = _dispatched(names)
    if not disabled:
        pytest.skip(f"this CPU / numpy build dispatches none of {names}")
    env = {**os.environ, "NPY_DISABLE_CPU_FEATURES": " ".join(disabled)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    check = (
        f"import {_umath().__name__} as u, sys; "
        "print([n for n in sys.argv[1:] if u.__cpu_features__.get(n)])"
    )
    still_on = subprocess.run(
        [sys.executable, "-c", check, *disabled],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    assert still_on == "[]", f"NPY_DISABLE_CPU_FEATURES had no effect: {still_on}"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SELECTION],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"with {disabled} off:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"
