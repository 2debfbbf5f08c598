"""Benchmark end-to-end training: the `mlp` model on a local cluster against plain Keras.

docs/benchmarks.md says how it measures and how to read it::

    python -m benchmarks.train                 # 150 steps of 1,024 examples, 2 rounds each
    python -m benchmarks.train --quick         # smoke run: 12 steps, 1 round each
    python -m benchmarks.train --profile       # plus one distributed run under py-spy
"""
