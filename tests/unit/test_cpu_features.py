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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
# the Keras parity and pow tests (Adam's beta**t), the initializers' golden values, and
# the compiled item coding against numpy's float16 casts (F16C's or not)
SELECTION = [
    "tests/unit/test_optimizers.py",
    "tests/unit/test_initializers.py",
    "tests/unit/test_item_coding.py",
    "-k",
    "matches_keras or beta_powers or golden or on_its_own",
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


_VARIANTS = {"no-avx512": _AVX512, "no-avx2": _AVX512 + _AVX2}


def _env(disabled: list[str]) -> dict[str, str]:
    env = {**os.environ, "NPY_DISABLE_CPU_FEATURES": " ".join(disabled)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


@dataclass
class _Selection:
    proc: subprocess.Popen[bytes]
    out: Path

    def result(self) -> tuple[int, str]:
        code = self.proc.wait(timeout=300)
        return code, self.out.read_text(errors="replace")


@pytest.fixture(scope="module")
def selections(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, _Selection]]:
    """The selection under every variant this CPU dispatches, started at once: most of a
    run is TensorFlow's import, and two side by side take little more than one."""
    out_dir = tmp_path_factory.mktemp("cpu-features")
    started: dict[str, _Selection] = {}
    try:
        for variant, names in _VARIANTS.items():
            disabled = _dispatched(names)
            if not disabled:
                continue
            out = out_dir / f"{variant}.log"
            with open(out, "wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SELECTION],
                    cwd=ROOT,
                    env=_env(disabled),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            started[variant] = _Selection(proc, out)
        yield started
    finally:
        for selection in started.values():
            if selection.proc.poll() is None:
                selection.proc.kill()
                selection.proc.wait(timeout=30)


@pytest.mark.timeout(330)  # the first waits on both selections sharing the cores
@pytest.mark.parametrize("variant", list(_VARIANTS))
def test_golden_values_with_simd_kernels_disabled(
    variant: str, selections: dict[str, _Selection]
) -> None:
    names = _VARIANTS[variant]
    disabled = _dispatched(names)
    if not disabled:
        pytest.skip(f"this CPU / numpy build dispatches none of {names}")
    check = (
        f"import {_umath().__name__} as u, sys; "
        "print([n for n in sys.argv[1:] if u.__cpu_features__.get(n)])"
    )
    still_on = subprocess.run(
        [sys.executable, "-c", check, *disabled],
        env=_env(disabled),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.strip()
    assert still_on == "[]", f"NPY_DISABLE_CPU_FEATURES had no effect: {still_on}"
    code, output = selections[variant].result()
    assert code == 0, f"with {disabled} off:\n{output[-6000:]}"
