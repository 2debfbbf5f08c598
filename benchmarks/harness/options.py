"""The command line every benchmark shares: `--quick`, `--out-dir`, the counts whose
default `--quick` lowers (`--rounds`, `--steps`, `--ids`, ...), `--warmup`, the quiet-wait
flags and `--row-flush-pushes`, each checked once here."""

from __future__ import annotations

import argparse
import sys
from argparse import SUPPRESS
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness.data import BATCH_SIZE
from benchmarks.harness.report import RESULTS_DIR
from benchmarks.harness.rounds import DISTURBED_SHARE, QUIET_SHARE
from lookup_table.config import MAX_ROW_FLUSH_PUSHES


class Options(argparse.ArgumentParser):
    """A benchmark's parser: `--quick` and `--out-dir`, and the shared flags it asks for;
    `parse` fills in the defaults `--quick` changes and rejects counts out of range."""

    def __init__(self, doc: str | None, *, quick: str) -> None:
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        super().__init__(
            prog=None if spec is None else f"python -m {spec.name.removesuffix('.__main__')}",
            description=(doc or "").split("\n\n")[0],
        )
        self._counts: list[tuple[str, int, int, int]] = []  # flag, full, quick, minimum
        self.defaulted: set[str] = set()  # after `parse`: the count flags not given
        self._quiet_wait_s: float | None = None
        self._warmup = False
        self._row_flush = False
        self.add_argument("--quick", action="store_true", help=f"smoke run: {quick}")
        self.add_argument(
            "--out-dir",
            type=Path,
            default=RESULTS_DIR,
            help="where the report (JSON, and PNG if any) goes (default benchmarks/results/)",
        )

    def count(
        self, flag: str, *, full: int, quick: int | None = None, help: str, minimum: int = 1
    ) -> None:
        """An int flag whose default is `full`, or `quick` with `--quick` (unless given)."""
        low = full if quick is None else quick
        default = f"default {full:,}" + ("" if low == full else f", {low:,} with --quick")
        self.add_argument(flag, type=int, default=None, help=f"{help} ({default})")
        self._counts.append((flag, full, low, minimum))

    def warmup(self, *, full: int, quick: int) -> None:
        """`--warmup`: untimed steps, in 1..steps-2 (needs `--steps`)."""
        self.count("--warmup", full=full, quick=quick, help="untimed steps")
        self._warmup = True

    def training(
        self,
        *,
        steps: tuple[int, int],
        warmup: tuple[int, int],
        rounds: tuple[int, int],
        wait_s: float,
        unit: str = "round",
    ) -> None:
        """The flags of a benchmark that trains the demo's model in timed `unit`s (rounds,
        runs), ABBA: `--steps`, `--warmup`, `--rounds` (each (full, quick)), `--batch-size`
        and the quiet-wait flags."""
        self.count("--steps", full=steps[0], quick=steps[1], help="train steps")
        self.warmup(full=warmup[0], quick=warmup[1])
        self.count("--rounds", full=rounds[0], quick=rounds[1], help=f"{unit}s of each kind")
        self.count("--batch-size", full=BATCH_SIZE, help="examples a step")
        self.quiet(unit=unit, wait_s=wait_s)

    def roles(self, roles: Sequence[str], *flags: str, **ints: int) -> None:
        """`--role` (`main`, or one of `roles`: a process the benchmark starts itself) and
        that process's string `flags` and int flags (`ints`: name -> default); hidden."""
        self.add_argument("--role", choices=["main", *roles], default="main", help=SUPPRESS)
        for flag in flags:
            self.add_argument(flag, help=SUPPRESS)
        for name, default in ints.items():
            self.add_argument(
                "--" + name.replace("_", "-"), type=int, default=default, help=SUPPRESS
            )

    def quiet(self, *, unit: str, wait_s: float) -> None:
        """`--quiet-wait-s` and `--retries` of a benchmark whose `unit`s (a round, a run)
        are timed windows on a shared machine."""
        self.add_argument(
            "--quiet-wait-s",
            type=float,
            default=None,
            help=f"before each {unit}, wait up to this long for other processes to use less "
            f"than {QUIET_SHARE * 100:.0f}%% of the machine (default {wait_s:.0f}; 0 with "
            "--quick)",
        )
        self.add_argument(
            "--retries",
            type=int,
            default=None,
            help=f"repeat a {unit} (up to this many times) when other processes used more "
            f"than {DISTURBED_SHARE * 100:.0f}%% of the machine during its window "
            "(default 2; 0 with --quick)",
        )
        self._quiet_wait_s = wait_s

    def row_flush_pushes(self, *, default: int | None, help: str) -> None:
        """`--row-flush-pushes`: the cluster's service.row_flush_pushes."""
        self.add_argument("--row-flush-pushes", type=int, default=default, help=help)
        self._row_flush = True

    def parse(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        args = self.parse_args(argv)
        for flag, full, quick, minimum in self._counts:
            dest = flag.removeprefix("--").replace("-", "_")
            value = getattr(args, dest)
            if value is None:
                value = quick if args.quick else full
                setattr(args, dest, value)
                self.defaulted.add(flag)
            if value < minimum:
                self.error(f"{flag} must be at least {minimum}, got {value}")
        if self._warmup and not args.warmup < args.steps - 1:
            self.error(f"--warmup must be in 1..steps-2, got {args.warmup} for {args.steps} steps")
        if self._quiet_wait_s is not None:
            if args.quiet_wait_s is None:
                args.quiet_wait_s = 0.0 if args.quick else self._quiet_wait_s
            if args.retries is None:
                args.retries = 0 if args.quick else 2
        if self._row_flush and args.row_flush_pushes is not None:
            if not 1 <= args.row_flush_pushes <= MAX_ROW_FLUSH_PUSHES:
                self.error(
                    f"--row-flush-pushes must be in 1..{MAX_ROW_FLUSH_PUSHES}, got "
                    f"{args.row_flush_pushes}"
                )
        return args
