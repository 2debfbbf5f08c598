"""Benchmark end-to-end training: the `mlp` model on a local cluster against plain Keras.

Run from the repository root::

    python -m benchmarks.train                 # 150 steps of 1,024 examples, 2 rounds each
    python -m benchmarks.train --quick         # smoke run: 12 steps, 1 round each
    python -m benchmarks.train --profile       # plus one distributed run under py-spy

The same model (`trainer.models.build_model("mlp")`: 26 embeddings of dim 16, the
13 numeric columns, Dense 256-128-1 with ReLU and a sigmoid output) trains on the
same `SyntheticSource` batches (seed 0, batch 1024, eval fraction 0.2) two ways:

* `local`: plain Keras in this process. Each categorical column gets its own
  `keras.layers.Embedding(100_000, 16)` (26 tables of 100k rows: what fits a
  single machine's Keras baseline); a column's int64 ids enter as `id mod 100_000`
  (`keras.ops.mod` inside the model). The synthetic ids already are the output of a
  bijective 64-bit mix, so the residue is a fixed hash; ids that collide share a
  row. Two Keras `Adam` optimizers, as the cluster file has them: learning rate 0.01
  on the embedding tables, 0.001 on the dense weights (beta_1 0.9, beta_2 0.999,
  epsilon 1e-7 on both sides). Keras 3's Adam updates every row of every table each step (m, v and
  the row move even for ids not in the batch); the service's Adam touches only the
  rows of the push, with a per-row step. The train step is one `tf.function`
  (forward, backward, both `apply_gradients`); each step's numpy batch is turned
  into tensors and its loss read back (`float(loss)`), as `Trainer.train_step` does.
* `distributed`: a local cluster from a temporary cluster file (deploy/demo.toml's
  tables and optimizer settings, fresh free ports, a fresh namespace, `workers =
  1`): 2 memcached nodes and 1 optimizer replica started with `python -m
  lookup_table.ops.localcluster up` and always stopped with `... down`; then one
  trainer process (this module with `--role trainer`, so TF state is its own)
  runs `trainer.Trainer.fit` with the Trainer's defaults (async mode, graph
  steps, dense weights refreshed every step, `max_pushes_in_flight` as the
  Trainer sets it unless `--pushes-in-flight` is given; the report records the
  value used) on the same model built by `build_model("mlp", ...)`.

Timing: both sides time steps `warmup+1 .. steps` (the first `--warmup`, default
10, are not timed: tracing, first connections, first rows). A step ends when its
loss is back in Python; the distributed window also includes the final drain of
pushes in flight and the dense-weight read before evaluation, and then the writes the
replicas still hold behind (a pause writes every row and the dense parameters to
memcached; then they resume): the window pays for every write its pushes deferred,
whatever `--row-flush-pushes` is (without it, a longer flush interval left more of
them out of a 150-step window). examples/s =
timed steps x batch / window seconds. Every round of each method builds a new
model (and a new cluster and namespace); rounds run in ABBA order (local,
distributed, distributed, local, ...) so a drift of the machine's load hits both.
Figures are medians over rounds; the ratio is distributed / local examples/s.
The machine is shared: a round whose window saw other processes use more than
15% of the machine is marked disturbed and run again (`--retries`, default 2);
the summary uses the undisturbed rounds of a method if it has any (every attempt
stays in the report's `rounds`).

Quality: after the same steps, both evaluate AUC and log loss on the same
held-out batches (`split="eval"`, the first `--eval-batches`, default 20). The
AUC of the data's own noise-free logit on those batches is the ceiling.

CPU: /proc/<pid>/stat (utime + stime) of every process taking part is read at the
start and end of the timed window (the cluster's pids from its run dir), and
/proc/stat for the whole machine: CPU ms per step per process, and the share of
the machine other processes used (the machine has 2 cores, shared). Examples per
CPU-second (of every process taking part) is reported too: on a shared machine
it moves much less with other jobs' load than examples/s does, and with 2 cores
total CPU bounds throughput. Before each round the benchmark waits (up to
`--quiet-wait-s`) for the machine to be quiet.

With `--profile`, one more distributed run (not in the table) has `py-spy
record --threads --idle --nonblocking` attached to the trainer and to the
optimizer service for the timed window; raw stacks go to
`<out-dir>/train-{trainer,service}.pyspy.txt` and the report gets, per thread,
ms per step by function (inclusive and leaf). `--idle` keeps blocked samples,
so a thread's figures are wall time, not CPU time; `waiting_ms_per_step` counts
the samples spent in an idle event loop or waiting on another thread.

The memcached nodes' `stats` counters (keys read and written, bytes in and out)
are read at the same two points as the CPU times: key operations per step, printed with
memcached's CPU per key operation (the same line as `benchmarks.push_replay`'s).

`--mode sync` (no prefetch, each step waits for its push: no staleness) and
`--pushes-in-flight N` change the distributed side only, to measure what
asynchrony costs in AUC; use `--out-dir` to keep such runs apart.

Results go to `<out-dir>/train.json` and `<out-dir>/train.png` (default
`benchmarks/results/`). The targets: distributed >= 1.0 x local
examples/s and examples per CPU-second, and eval AUC within 0.01 of local after the
same steps (they are reported, not enforced). Any failure
exits non-zero; the cluster is always stopped.
"""
