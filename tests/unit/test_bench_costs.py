"""`benchmarks.harness.costs`: samples go to the category of their innermost frame, and a
process's /proc CPU is shared out thread by thread in its samples' proportions."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from benchmarks.harness import costs

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("leaf", "expected"),
    [
        ("quick_execute (tensorflow/python/eager/execute.py:53)", "math"),
        ("Adam.update_at (lookup_table/core/optimizers/adam.py:338)", "math"),
        ("packb (msgpack/__init__.py:36)", "bytes"),
        ("_SelectorSocketTransport.write (asyncio/selector_events.py:1057)", "bytes"),
        ("decode_array (lookup_table/core/wire.py:157)", "bytes"),
        ("TrainingSession.step (lookup_table/keras/session.py:452)", "else"),
        ("call_soon (asyncio/base_events.py:806)", "else"),
        ("BaseSelectorEventLoop._write_to_self (asyncio/selector_events.py:139)", "else"),
        ("(no python frame)", "else"),
    ],
)
def test_a_sample_goes_to_its_innermost_frames_category(leaf: str, expected: str) -> None:
    assert costs.category(leaf) == expected


def test_a_process_cpu_is_split_by_its_threads_samples(tmp_path: Path) -> None:
    spy = tmp_path / "p.pyspy.txt"
    spy.write_text(
        "thread (10): MainThread;run (a.py:1);"
        "quick_execute (tensorflow/python/eager/execute.py:5) 3\n"
        "thread (10): MainThread;run (a.py:1);packb (msgpack/__init__.py:36) 1\n"
        "thread (11): Thread-1;loop (b.py:2) 2\n"
    )
    samples = costs.samples_by_thread(spy)
    start = {"10": [1.0, 0.0], "11": [0.0, 0.0], "12": [5.0, 0.0]}
    # thread 10: 40 ms over 2 steps; 11: 10 ms; 12 (no Python samples): 6 ms
    end = {"10": [1.03, 0.01], "11": [0.01, 0.0], "12": [5.006, 0.0]}
    got = costs.python_process(samples, start, end, steps=2, native_category="math")
    assert got["cpu_ms_per_step"] == pytest.approx(28.0)
    assert got["math_ms_per_step"] == pytest.approx(15.0 + 3.0)
    assert got["bytes_ms_per_step"] == pytest.approx(5.0)
    assert got["else_ms_per_step"] == pytest.approx(5.0)
    assert got["unsampled_threads_ms_per_step"] == pytest.approx(3.0)
    assert got["samples"] == 6


def test_memcached_kernel_time_is_bytes_moved_and_user_time_the_rest() -> None:
    got = costs.memcached_process({"1": [1.0, 2.0]}, {"1": [1.01, 2.03]}, steps=10)
    assert (got["else_ms_per_step"], got["bytes_ms_per_step"]) == pytest.approx((1.0, 3.0))
    assert got["math_ms_per_step"] == 0.0


def test_this_process_threads_are_read_from_proc() -> None:
    threads = costs.task_cpu_s(os.getpid())
    assert str(os.getpid()) in threads
    assert all(len(v) == 2 and min(v) >= 0 for v in threads.values())
