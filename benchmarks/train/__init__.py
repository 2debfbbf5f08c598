"""Benchmark end-to-end training: the `mlp` model on a local cluster against the same
model trained locally, by lazy Adam (the service's math, the headline) and by Keras'
dense Adam, and the MLP alone (the compute floor).

docs/benchmarks.md says how it measures and how to read it::

    python -m benchmarks.train                 # 150 steps of 1,024 examples, 2 rounds each
    python -m benchmarks.train --quick         # smoke run: 12 steps, 1 round each
    python -m benchmarks.train --profile       # plus the cost table per process (py-spy)
"""
