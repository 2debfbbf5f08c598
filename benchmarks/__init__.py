"""The benchmarks: one module a benchmark, run from the repository root as
`python -m benchmarks.<name>` (`--quick` for a smoke run, `--help` for the options).

The shared parts (options, rounds and quiet-wait, local clusters, data, the report and
its plots) are in `benchmarks.harness`. Results go to `benchmarks/results/`.
"""
