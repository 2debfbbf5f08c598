"""`DistributedEmbedding` (lookup_table.keras) against references we did not write.

On the same table values the layer must compute what `keras.layers.Embedding`
computes (combiner=None) and what `tf.nn.safe_embedding_lookup_sparse` computes
(combiners), forward and backward: the gradients the trainer reads from the
recorded rows tensors, scattered to their ids' rows, must be the gradient of the
same loss w.r.t. the reference's table, and zero wherever the layer recorded no id.

Every comparison runs in both of the layer's execution paths (the `mode`
fixture): "eager" (the trainer with graph=False: `layer.records` hold the watched
rows tensors) and "graph" (the trainer's default: one `tf.function` step whose
lookups run as py_functions; the gradients w.r.t. `layer.graph_rows` are paired
with `layer.graph_records` after the call). `Stepper` runs a step as
trainer/loop.py does in each mode. Section 6 covers what only graph mode has:
retraces (reduce_retracing) reusing a trace after a newer one, several layers
and lookups in one step, and the same fetches as eager under padding and pruning.

The rows come from `MemorySource`, an in-memory `RowSource` (the store has its
own tests; this is the layer's math). It records every request, so each test
also checks that a call asks for its unique contributing ids exactly once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow", reason="tensorflow is not importable: the layer needs it")
keras = pytest.importorskip("keras", reason="keras is not importable: the layer needs it")

from lookup_table.config import TableSpec  # noqa: E402
from lookup_table.keras import DistributedEmbedding, RecordedLookup  # noqa: E402

pytestmark = pytest.mark.unit

DIM = 8
VOCAB = 50
ATOL = 1e-6
TABLE = "emb"
PAD = 0
COMBINERS = ["sum", "mean", "sqrtn"]
MODES = ["eager", "graph"]

V: NDArray[np.float32] = (
    np.random.default_rng(20240611).normal(size=(VOCAB, DIM)).astype(np.float32)
)

# String ids: WORDS[i] is row i. Non-ASCII and a space check that tf.string bytes
# reach the source as the same str ids.
WORDS = [f"w{i}" for i in range(VOCAB)]
WORDS[3], WORDS[7], WORDS[11] = "naïve", "a b", "日本"
ROW_OF_WORD = {w: i for i, w in enumerate(WORDS)}


class MemorySource:
    """A `RowSource` over an in-memory table that records every request.

    An int id `i` is row `i + offset`; a str id is row `ROW_OF_WORD[id]`.
    """

    def __init__(self, table: NDArray[np.float32] = V, *, offset: int = 0) -> None:
        self.table = table
        self.offset = offset
        self.requests: list[NDArray[Any]] = []
        self.training: list[bool] = []

    def row_index(self, ids: NDArray[Any]) -> NDArray[np.int64]:
        if ids.dtype == object:
            assert all(type(s) is str for s in ids.tolist()), ids
            return np.array([ROW_OF_WORD[s] for s in ids.tolist()], dtype=np.int64)
        assert ids.dtype == np.int64, ids.dtype
        return ids + self.offset

    def rows(self, table: str, ids: NDArray[Any], *, training: bool) -> NDArray[np.float32]:
        assert table == TABLE
        self.requests.append(np.array(ids, copy=True))
        self.training.append(training)
        return self.table[self.row_index(ids)]


def bound_layer(
    combiner: str | None = None, *, source: MemorySource | None = None, **kwargs: Any
) -> tuple[DistributedEmbedding, MemorySource]:
    source = MemorySource() if source is None else source
    layer = DistributedEmbedding(TABLE, combiner, dim=DIM, **kwargs)
    layer.bind(source)
    return layer, source


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    """The layer's execution path: "eager", or "graph" (inside the trainer's tf.function)."""
    return str(request.param)


def run_in(mode: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs), eagerly or traced and run as a tf.function."""
    return fn(*args, **kwargs) if mode == "eager" else tf.function(fn)(*args, **kwargs)


# ---------------------------------------- running and comparing


@dataclass
class Result:
    out: Any  # tf.Tensor, or tf.RaggedTensor
    grad: NDArray[np.float32]  # (VOCAB, DIM): d loss / d table row
    fetched: NDArray[np.bool_] | None = None  # (VOCAB,): rows the layer looked up


# loss = sum(out * W) with W the first out.size values of a fixed random pool, so
# every output element matters; it takes a dynamic shape (ragged values, retraces)
LOSS_POOL: NDArray[np.float32] = (
    np.random.default_rng(99).uniform(-1.0, 1.0, size=4096).astype(np.float32)
)


def weighted_sum(out: Any) -> Any:
    values = out.flat_values if isinstance(out, tf.RaggedTensor) else out
    # (an output larger than the pool fails in the reshape)
    weights = tf.reshape(tf.constant(LOSS_POOL)[: tf.size(values)], tf.shape(values))
    return tf.reduce_sum(values * weights)


def dense_grad(grad: Any) -> NDArray[np.float32]:
    assert grad is not None, "the loss does not depend on the rows"
    return np.asarray(tf.convert_to_tensor(grad).numpy())


@dataclass
class Step:
    """What one training step gives the trainer."""

    out: Any  # what `forward` returned as outputs (eager tensors)
    loss: float
    records: list[RecordedLookup]  # one per lookup: the table and the unique ids
    grads: list[NDArray[np.float32]]  # d loss / d rows, paired with `records`
    trace: int | None = None  # graph: which trace of the step ran (1, 2, ...)


class Stepper:
    """Runs `forward(*args, **kwargs) -> (outputs, loss)` as the trainer runs a step.

    eager (`Trainer.train_step`, graph=False): under a tape, after
    `begin_step(tape)`; the gradients w.r.t. the rows of `layer.records`.

    graph (`Trainer._make_graph_step`): one `tf.function(reduce_retracing=True)`
    kept across calls; at trace time `begin_step(tape)` starts a trace and the
    gradients are taken w.r.t. `layer.graph_rows` before `end_step()`; after each
    call the returned gradients pair, in order, with
    `layer.graph_records[:len(layer.graph_rows)]`, as `Trainer.train_step` pairs
    them. `traces` counts the traces.
    """

    def __init__(
        self, layers: Sequence[DistributedEmbedding], forward: Callable[..., Any], mode: str
    ) -> None:
        assert mode in MODES
        self.layers = list(layers)
        self.forward = forward
        self.mode = mode
        self.traces = 0
        self._graph_step = tf.function(self._traced_step, reduce_retracing=True)

    def _traced_step(self, *args: Any, **kwargs: Any) -> Any:
        self.traces += 1
        with tf.GradientTape() as tape:
            for layer in self.layers:
                layer.begin_step(tape)  # at trace time: a new trace, rows watched
            out, loss = self.forward(*args, **kwargs)
        rows = [r for layer in self.layers for r in layer.graph_rows]
        grads = tape.gradient(loss, rows)
        for layer in self.layers:
            layer.end_step()
        # the trainer turns a None gradient into zeros; None stays None here, so that
        # dense_grad() can fail on a loss that does not depend on the rows
        grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]
        return out, loss, grads, tf.constant(self.traces)

    def __call__(self, *args: Any, **kwargs: Any) -> Step:
        if self.mode == "graph":
            out, loss, grads, trace_t = self._graph_step(*args, **kwargs)
            trace: int | None = int(trace_t)
            records = [
                rec for layer in self.layers for rec in layer.graph_records[: len(layer.graph_rows)]
            ]
            assert all(rec is not None for rec in records), "a lookup of the step recorded no ids"
        else:
            with tf.GradientTape() as tape:
                for layer in self.layers:
                    layer.begin_step(tape)
                out, loss = self.forward(*args, **kwargs)
            records = [r for layer in self.layers for r in layer.records]
            grads = tape.gradient(loss, [r.rows for r in records])
            for layer in self.layers:
                layer.begin_step(None)
            trace = None
        assert len(records) == len(grads), f"{len(records)} records for {len(grads)} gradients"
        dense = [dense_grad(g) for g in grads]
        for record, grad in zip(records, dense, strict=True):
            assert record.table == TABLE
            assert grad.shape == (len(record.ids), DIM), "a gradient paired with the wrong ids"
        return Step(out, float(loss), records, dense, trace)


def embed_and_sum(layer: Callable[..., Any]) -> Callable[..., Any]:
    """forward(inputs, **kwargs) = (layer(inputs, **kwargs), weighted_sum of it)."""

    def forward(inputs: Any, **kwargs: Any) -> Any:
        out = layer(inputs, **kwargs)
        return out, weighted_sum(out)

    return forward


def run_layer(
    layer: DistributedEmbedding,
    source: MemorySource,
    inputs: Any,
    ids: list[Any],
    mode: str,
    *,
    stepper: Stepper | None = None,
    **kwargs: Any,
) -> Result:
    """One training step's worth, in `mode`: output and table gradient, as the trainer
    computes them (with `stepper`, a step of it: the same tf.function across calls).

    `ids` are the ids that must reach the source (with repeats): one request, of
    their unique values, recorded with the rows the gradient is paired with.
    """
    before = len(source.requests)
    stepper = Stepper([layer], embed_and_sum(layer), mode) if stepper is None else stepper
    step = stepper(inputs, **kwargs)
    requests = source.requests[before:]
    assert len(requests) == 1, f"one call must look its ids up once, got {len(requests)}"
    assert len(step.records) == 1, f"one call must record one lookup, got {len(step.records)}"
    request, record = requests[0].tolist(), step.records[0]
    assert len(set(request)) == len(request), f"an id was requested twice: {request}"
    assert sorted(request) == sorted(set(ids))
    assert record.ids.tolist() == request, "the recorded ids are the fetched ids"
    fetched = np.zeros(VOCAB, dtype=bool)
    fetched[source.row_index(record.ids)] = True
    return Result(step.out, table_grad(source, step.records, step.grads), fetched)


def table_grad(source: MemorySource, records: list[Any], grads: list[Any]) -> NDArray[np.float32]:
    """The gradients w.r.t. the recorded rows, added to the table rows of their ids."""
    full = np.zeros((VOCAB, DIM), np.float32)
    for record, grad in zip(records, grads, strict=True):
        rows = dense_grad(grad)
        assert rows.shape == (len(record.ids), DIM)
        np.add.at(full, source.row_index(record.ids), rows)
    return full


def keras_reference(ids: Any, table: NDArray[np.float32] = V) -> Result:
    """`keras.layers.Embedding` with its embeddings set to `table`."""
    emb = keras.layers.Embedding(VOCAB, DIM)
    emb.build(None)
    emb.embeddings.assign(table)
    with tf.GradientTape() as tape:
        out = emb(ids)
        loss = weighted_sum(out)
    return Result(out, dense_grad(tape.gradient(loss, emb.embeddings)))


def gather_reference(ids: Any, table: NDArray[np.float32] = V) -> Result:
    """`tf.gather` from a table variable (it takes ragged indices)."""
    var = tf.Variable(table)
    with tf.GradientTape() as tape:
        out = tf.gather(var, ids)
        loss = weighted_sum(out)
    return Result(out, dense_grad(tape.gradient(loss, var)))


def sparse_reference(ids: Any, weights: Any, combiner: str, offset: int = 0) -> Result:
    """`tf.nn.safe_embedding_lookup_sparse` on a table variable holding V."""
    var = tf.Variable(V)
    if offset:
        ids = tf.SparseTensor(ids.indices, ids.values + offset, ids.dense_shape)
    with tf.GradientTape() as tape:
        out = tf.nn.safe_embedding_lookup_sparse(var, ids, weights, combiner=combiner)
        loss = weighted_sum(out)
    return Result(out, dense_grad(tape.gradient(loss, var)))


def max_abs_error(got: Any, want: Any) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    return float(np.max(np.abs(got - want), initial=0.0))


def assert_close(got: Any, want: Any, atol: float = ATOL) -> None:
    err = max_abs_error(got, want)
    assert err <= atol, f"max abs error {err:.3g} > {atol:.3g}"


def output_values(out: Any) -> NDArray[np.float32]:
    return np.asarray(out.flat_values if isinstance(out, tf.RaggedTensor) else out)


def assert_matches(got: Result, want: Result, atol: float = ATOL) -> None:
    assert isinstance(got.out, tf.RaggedTensor) == isinstance(want.out, tf.RaggedTensor)
    assert tuple(got.out.shape) == tuple(want.out.shape)
    if isinstance(want.out, tf.RaggedTensor):
        assert got.out.row_splits.numpy().tolist() == want.out.row_splits.numpy().tolist()
    assert_close(output_values(got.out), output_values(want.out), atol)
    assert_close(got.grad, want.grad, atol)
    # the reference's gradient lives only on rows the layer fetched: exactly zero elsewhere
    assert got.fetched is not None
    assert not np.any(want.grad[~got.fetched]), "the reference has gradient on unfetched ids"


def int_ids(shape: tuple[int, ...], seed: int) -> NDArray[np.int64]:
    ids = np.random.default_rng(seed).integers(0, VOCAB, size=shape, dtype=np.int64)
    if ids.size >= 2:
        ids.reshape(-1)[1] = ids.reshape(-1)[0]  # a repeated id: its gradients must add up
    return ids


# ---------------------------------------- 1. combiner=None vs keras


@pytest.mark.parametrize(
    "shape", [(6,), (6, 4), (3, 4, 2), (), (0, 4)], ids=["b", "b-k", "b-k-m", "scalar", "empty"]
)
def test_matches_keras_embedding(shape: tuple[int, ...], mode: str) -> None:
    ids = int_ids(shape, seed=len(shape))
    layer, source = bound_layer()
    got = run_layer(layer, source, tf.constant(ids), ids.reshape(-1).tolist(), mode)
    assert tuple(got.out.shape) == (*shape, DIM)
    assert_matches(got, keras_reference(tf.constant(ids)))


def two_calls(layer: DistributedEmbedding) -> Callable[..., Any]:
    """forward(a, b): the layer called twice in one step, loss = ws(a) + 2 ws(b)."""

    def forward(a: Any, b: Any) -> Any:
        out_a, out_b = layer(a, training=True), layer(b, training=True)
        return (out_a, out_b), weighted_sum(out_a) + 2.0 * weighted_sum(out_b)

    return forward


def test_two_calls_in_one_step_record_two_lookups(mode: str) -> None:
    a, b = int_ids((5, 3), seed=1), int_ids((4,), seed=2)
    b[0] = a[0, 0]  # an id in both calls: the trainer adds its two gradients
    layer, source = bound_layer()
    step = Stepper([layer], two_calls(layer), mode)(tf.constant(a), tf.constant(b))
    assert [r.ids.tolist() for r in step.records] == [sorted(set(a.ravel())), sorted(set(b))]
    assert [r.tolist() for r in source.requests] == [r.ids.tolist() for r in step.records]
    assert source.training == [True, True]

    emb = keras.layers.Embedding(VOCAB, DIM)
    emb.build(None)
    emb.embeddings.assign(V)
    with tf.GradientTape() as tape:
        ref_a, ref_b = emb(tf.constant(a)), emb(tf.constant(b))
        ref_loss = weighted_sum(ref_a) + 2.0 * weighted_sum(ref_b)
    want = dense_grad(tape.gradient(ref_loss, emb.embeddings))
    assert_close(step.out[0].numpy(), ref_a.numpy())
    assert_close(step.out[1].numpy(), ref_b.numpy())
    assert_close(table_grad(source, step.records, step.grads), want)
    assert_close(step.loss, float(ref_loss), atol=1e-5)  # a sum of ~50 terms of size ~1


def test_a_call_outside_a_step_records_nothing(mode: str) -> None:
    """Eager: no tape, no record. Graph: a predict trace (no begin_step, as the
    trainer's evaluate) neither adds a slot to the training trace nor overwrites
    its records, and the training step still pairs its gradients afterwards."""
    a = int_ids((5, 3), seed=1)
    other = np.array([[41, 42], [43, 41]], dtype=np.int64)
    layer, source = bound_layer("mean")
    stepper = Stepper([layer], embed_and_sum(layer), mode)
    first = stepper(tf.constant(a), training=True)
    assert [r.ids.tolist() for r in first.records] == [sorted(set(a.ravel()))]

    if mode == "eager":
        layer(tf.constant(other))
        assert layer.records == [], "no tape, nothing recorded"
    else:
        rows, records = list(layer.graph_rows), list(layer.graph_records)
        out = tf.function(lambda x: layer(x, training=False), reduce_retracing=True)(
            tf.constant(other)
        )
        assert_close(out.numpy(), V[other].mean(axis=1))
        assert [id(r) for r in layer.graph_rows] == [id(r) for r in rows], (
            "a predict trace changed the rows of the training trace"
        )
        assert [r.ids.tolist() for r in layer.graph_records] == [r.ids.tolist() for r in records], (
            "a predict call overwrote a training record"
        )
    assert [r.tolist() for r in source.requests[1:]] == [[41, 42, 43]]
    assert source.training == [True, False]

    again = stepper(tf.constant(a), training=True)
    assert stepper.traces == (1 if mode == "graph" else 0), "the step was not reused"
    assert [r.ids.tolist() for r in again.records] == [sorted(set(a.ravel()))]
    first_grad = table_grad(source, first.records, first.grads)
    assert first_grad.any()
    assert_close(table_grad(source, again.records, again.grads), first_grad)


# ---------------------------------------- 2. padding_id


def padded_table() -> NDArray[np.float32]:
    table = V.copy()
    table[PAD] = 0.0
    return table


def without_pad_grad(result: Result) -> Result:
    """A padded position's gradient belongs to no row (the trainer must not push it)."""
    grad = result.grad.copy()
    grad[PAD] = 0.0
    return Result(result.out, grad)


@pytest.mark.parametrize("shape", [(6,), (5, 4), (2, 3, 4)], ids=["b", "b-k", "b-k-m"])
def test_padding_without_combiner_is_a_zero_vector(shape: tuple[int, ...], mode: str) -> None:
    ids = int_ids(shape, seed=7)
    ids.reshape(-1)[[0, 2, -1]] = PAD
    layer, source = bound_layer(padding_id=PAD)
    got = run_layer(layer, source, tf.constant(ids), [i for i in ids.ravel() if i != PAD], mode)
    assert not np.any(got.out.numpy()[ids == PAD]), "padded positions must be zero vectors"
    # keras.layers.Embedding on a table whose padding row is zero
    assert_matches(got, without_pad_grad(keras_reference(tf.constant(ids), padded_table())))


def test_padding_without_combiner_ragged(mode: str) -> None:
    ids = tf.ragged.constant([[PAD, 4, 9], [], [PAD], [5, PAD, 5]], dtype=tf.int64)
    layer, source = bound_layer(padding_id=PAD)
    got = run_layer(layer, source, ids, [4, 9, 5], mode)
    assert_matches(got, without_pad_grad(gather_reference(ids, padded_table())))


# ---------------------------------------- 3. combiners vs tf.nn.safe_embedding_lookup_sparse

DENSE_1D = np.array([4, 17, 4, 0, 49, 23], dtype=np.int64)
DENSE_2D = np.array(
    [[4, 17, 4, 9], [0, 0, 0, 0], [49, 1, 23, 8], [5, 6, 7, 5], [12, 31, 12, 12]], dtype=np.int64
)
DENSE_3D = np.array(
    [
        [[3, 3, 0, 8], [9, 10, 11, 12]],
        [[0, 0, 1, 2], [40, 41, 42, 3]],
        [[5, 5, 5, 5], [0, 6, 7, 8]],
    ],
    dtype=np.int64,
)
RAGGED = [[3, 7, 3], [], [0], [49, 12, 5, 5, 1], [], [8, 8]]
# (6, 5) with empty rows 1 and 4, a repeated id in row 2
SPARSE_INDICES = [[0, 0], [0, 3], [2, 0], [2, 1], [2, 2], [2, 4], [3, 1], [5, 0], [5, 1], [5, 2]]
SPARSE_VALUES = [2, 40, 11, 11, 0, 33, 49, 7, 2, 21]
SPARSE_SHAPE = [6, 5]
POSITIVE_WEIGHTS = [1.5, 0.25, 0.5, 2.0, 0.75, 1.25, 0.3, 1.0, 1.75, 0.6]
# zero weights: row 3's only id has weight 0, so row 3 is zeros
ZERO_WEIGHTS = [1.5, 0.0, 0.5, 2.0, 0.0, 1.25, 0.0, 1.0, 1.75, 0.6]
# zero and negative weights (pruned by mean and sqrtn, not by sum)
PRUNED_WEIGHTS = [1.5, 0.0, -0.5, 2.0, 0.75, -1.0, 0.0, 0.3, -2.0, 1.25]
KINDS = [
    "dense_1d",
    "dense_column",
    "dense_2d",
    "dense_3d",
    "ragged",
    "sparse",
    "sparse_weighted",
    "sparse_zero_weights",
    "sparse_pruned",
]


@dataclass
class Case:
    inputs: Any  # what the layer is called on
    weights: Any  # sparse_weights (layer and reference), or None
    ref_ids: Any  # the same ids as the SparseTensor safe_embedding_lookup_sparse takes


def sparse(indices: Any, values: Any, shape: Any, dtype: Any = tf.int64) -> Any:
    return tf.SparseTensor(
        tf.constant(indices, tf.int64), tf.constant(values, dtype), tf.constant(shape, tf.int64)
    )


def dense_as_sparse(ids: NDArray[np.int64]) -> Any:
    """Every position of dense ids (tf.sparse.from_dense would drop id 0)."""
    return sparse(np.argwhere(np.ones(ids.shape, dtype=bool)), ids.reshape(-1), ids.shape)


def combiner_case(kind: str) -> Case:
    if kind == "dense_1d":  # a 1-D batch is (b, 1): one id per example, as for keras.Input(())
        return Case(tf.constant(DENSE_1D), None, dense_as_sparse(DENSE_1D.reshape(-1, 1)))
    if kind == "dense_column":  # (b, 1): one id per example on a last axis of 1
        column = DENSE_1D.reshape(-1, 1)
        return Case(tf.constant(column), None, dense_as_sparse(column))
    if kind in ("dense_2d", "dense_3d"):
        ids = DENSE_2D if kind == "dense_2d" else DENSE_3D
        return Case(tf.constant(ids), None, dense_as_sparse(ids))
    if kind == "ragged":
        ids = tf.ragged.constant(RAGGED, dtype=tf.int64)
        return Case(ids, None, ids.to_sparse())
    ids = sparse(SPARSE_INDICES, SPARSE_VALUES, SPARSE_SHAPE)
    weights = {
        "sparse": None,
        "sparse_weighted": POSITIVE_WEIGHTS,
        "sparse_zero_weights": ZERO_WEIGHTS,
        "sparse_pruned": PRUNED_WEIGHTS,
    }
    w = weights[kind]
    sparse_weights = None if w is None else sparse(SPARSE_INDICES, w, SPARSE_SHAPE, tf.float32)
    return Case(ids, sparse_weights, ids)


def contributing(
    ref_ids: Any, weights: Any, combiner: str | None, padding_id: int | None = None
) -> tuple[list[int], NDArray[np.bool_]]:
    """The ids that must be fetched, and which output rows have any of them.

    As safe_embedding_lookup_sparse: mean and sqrtn prune weights <= 0; sum keeps
    negative weights, and an id of weight 0 adds exactly nothing (no need to fetch it).
    """
    values = ref_ids.values.numpy()
    keep = np.ones(values.shape, dtype=bool)
    if weights is not None:
        w = weights.values.numpy()
        keep &= w != 0 if combiner == "sum" else w > 0
    if padding_id is not None:
        keep &= values != padding_id
    shape = ref_ids.dense_shape.numpy()[:-1]
    nonempty = np.zeros(shape, dtype=bool)
    nonempty[tuple(ref_ids.indices.numpy()[keep, :-1].T)] = True
    return values[keep].tolist(), nonempty


@pytest.mark.parametrize(
    ("combiner", "kind"),
    [
        pytest.param(
            combiner,
            kind,
            id=f"{combiner}-{kind}",
            marks=[],
        )
        for combiner in COMBINERS
        for kind in KINDS
    ],
)
def test_combiner_matches_safe_embedding_lookup_sparse(combiner: str, kind: str, mode: str) -> None:
    case = combiner_case(kind)
    layer, source = bound_layer(combiner)
    kwargs = {} if case.weights is None else {"sparse_weights": case.weights}
    ids, nonempty = contributing(case.ref_ids, case.weights, combiner)
    got = run_layer(layer, source, case.inputs, ids, mode, **kwargs)
    assert_matches(got, sparse_reference(case.ref_ids, case.weights, combiner))
    assert not np.any(got.out.numpy()[~nonempty]), "a row with no ids must be zeros"
    if kind in ("ragged", "sparse", "sparse_zero_weights"):
        assert not nonempty.all(), "the case must have an empty row"


@pytest.mark.parametrize(
    "kind", ["dense_1d", "dense_column", "dense_2d", "dense_3d", "ragged", "sparse_zero_weights"]
)
@pytest.mark.parametrize("combiner", COMBINERS)
def test_padding_is_excluded_from_combiners(combiner: str, kind: str, mode: str) -> None:
    case = combiner_case(kind)
    layer, source = bound_layer(combiner, padding_id=PAD)
    kwargs = {} if case.weights is None else {"sparse_weights": case.weights}
    ids, nonempty = contributing(case.ref_ids, case.weights, combiner, padding_id=PAD)
    assert PAD in case.ref_ids.values.numpy().tolist() and PAD not in ids
    got = run_layer(layer, source, case.inputs, ids, mode, **kwargs)
    # the reference gets the SparseTensor of the non-padding positions
    keep = tf.not_equal(case.ref_ids.values, PAD)
    ref_ids = tf.sparse.retain(case.ref_ids, keep)
    ref_weights = None if case.weights is None else tf.sparse.retain(case.weights, keep)
    assert_matches(got, sparse_reference(ref_ids, ref_weights, combiner))
    assert not np.any(got.out.numpy()[~nonempty]), "a row of padding only must be zeros"


@pytest.mark.parametrize("padding_id", [None, PAD])
@pytest.mark.parametrize("kind", ["dense_1d", "dense_column"])
@pytest.mark.parametrize("combiner", COMBINERS)
def test_one_id_per_example_combines_to_its_row_exactly(
    combiner: str, kind: str, padding_id: int | None
) -> None:
    """One id per group (1-D ids, or a last axis of 1): every combiner gives that id's row,
    a padding id zeros, to the last bit, and the graph (which skips the segment sums)
    gives the eager path's floats and gradients."""
    case = combiner_case(kind)
    ids, _ = contributing(case.ref_ids, None, combiner, padding_id=padding_id)
    got = {}
    for mode in MODES:
        layer, source = bound_layer(combiner, padding_id=padding_id)
        got[mode] = run_layer(layer, source, case.inputs, ids, mode)
    flat = DENSE_1D
    want = source.table[source.row_index(flat)]
    if padding_id is not None:
        want[flat == padding_id] = 0.0
    for result in got.values():
        out = result.out.numpy()
        assert out.shape == (flat.shape[0], DIM)
        np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(got["graph"].grad, got["eager"].grad)


def test_negative_ids_are_real_ids(mode: str) -> None:
    """Unlike safe_embedding_lookup_sparse, a negative id is an id: -25 is row 0 here."""
    offset = 25
    source = MemorySource(offset=offset)
    ids = int_ids((4, 3), seed=5) - offset
    assert (ids < 0).any()
    layer, _ = bound_layer(source=source)
    got = run_layer(layer, source, tf.constant(ids), ids.ravel().tolist(), mode)
    assert_matches(got, keras_reference(tf.constant(ids + offset)))

    layer, _ = bound_layer("mean", source=source)
    sp = dense_as_sparse(ids)
    got = run_layer(layer, source, sp, ids.ravel().tolist(), mode)
    assert_matches(got, sparse_reference(sp, None, "mean", offset=offset))


# ---------------------------------------- 4. string ids

WORDS_T = tf.constant(WORDS)


def to_words(inputs: Any, words: Any = WORDS_T) -> Any:
    """The same ids as tf.string: id i becomes words[i]."""
    if isinstance(inputs, tf.SparseTensor):
        return tf.SparseTensor(inputs.indices, tf.gather(words, inputs.values), inputs.dense_shape)
    if isinstance(inputs, tf.RaggedTensor):
        return inputs.with_flat_values(tf.gather(words, inputs.flat_values))
    return tf.gather(words, inputs)


@pytest.mark.parametrize(
    ("combiner", "kind"),
    [
        pytest.param(combiner, kind, id=f"{combiner}-{kind}")
        for combiner in [None, *COMBINERS]
        for kind in ["dense_1d", "dense_2d", "dense_3d", "ragged", "sparse_zero_weights"]
        if combiner or not kind.startswith("sparse")  # a SparseTensor needs a combiner
    ],
)
def test_string_ids_match_int_ids(combiner: str | None, kind: str, mode: str) -> None:
    case = combiner_case(kind)
    kwargs = {} if case.weights is None else {"sparse_weights": case.weights}
    ids, _ = contributing(case.ref_ids, case.weights, combiner)
    # the int ids, eagerly (matched against the references by the tests above)
    int_layer, int_source = bound_layer(combiner)
    want = run_layer(int_layer, int_source, case.inputs, ids, "eager", **kwargs)
    str_layer, str_source = bound_layer(combiner)
    words = to_words(case.inputs)
    assert words.dtype == tf.string
    got = run_layer(str_layer, str_source, words, [WORDS[i] for i in ids], mode, **kwargs)
    assert_matches(got, want)


@pytest.mark.parametrize("kind", ["dense_2d", "ragged"])
@pytest.mark.parametrize("combiner", [None, "mean"])
def test_string_padding(combiner: str | None, kind: str, mode: str) -> None:
    case = combiner_case(kind)
    ids, _ = contributing(case.ref_ids, None, combiner, padding_id=PAD)
    int_layer, int_source = bound_layer(combiner, padding_id=PAD)
    want = run_layer(int_layer, int_source, case.inputs, ids, "eager")
    str_layer, str_source = bound_layer(combiner, padding_id="")
    words = to_words(case.inputs, tf.constant(["", *WORDS[1:]]))  # id PAD=0 becomes ""
    got = run_layer(str_layer, str_source, words, [WORDS[i] for i in ids], mode)
    assert_matches(got, want)


# ---------------------------------------- 5. ragged, combiner=None


def test_ragged_without_combiner_is_a_ragged_gather(mode: str) -> None:
    ids = tf.ragged.constant(RAGGED, dtype=tf.int64)
    layer, source = bound_layer()
    got = run_layer(layer, source, ids, [i for row in RAGGED for i in row], mode)
    assert isinstance(got.out, tf.RaggedTensor)
    assert got.out.shape.as_list() == [len(RAGGED), None, DIM]
    for out_row, row in zip(got.out, RAGGED, strict=True):
        assert_close(out_row.numpy(), V[np.array(row, dtype=np.int64)])
    assert_matches(got, gather_reference(ids))


# ---------------------------------------- 6. the trainer's tf.function: retraces, several layers


def random_case(
    kind: str, rows: int, cols: int, distinct: int, seed: int
) -> tuple[Case, list[int]]:
    """A batch of `rows` examples of up to `cols` ids drawn from `distinct` ids; and its
    ids (with repeats). "sparse" has positive weights."""
    rng = np.random.default_rng(seed)
    pool = rng.choice(VOCAB, size=distinct, replace=False).astype(np.int64)
    if kind == "dense":
        ids = rng.choice(pool, size=(rows, cols))
        return Case(tf.constant(ids), None, dense_as_sparse(ids)), ids.ravel().tolist()
    if kind == "ragged":
        lengths = rng.integers(0, cols + 1, size=rows)
        lengths[0] = cols  # the dense shape of the reference's SparseTensor is (rows, cols)
        values = rng.choice(pool, size=int(lengths.sum()))
        ragged = tf.RaggedTensor.from_row_lengths(
            tf.constant(values, tf.int64), tf.constant(lengths, tf.int64)
        )
        return Case(ragged, None, ragged.to_sparse()), values.tolist()
    assert kind == "sparse"
    mask = rng.random((rows, cols)) < 0.6
    mask[0, 0] = True
    indices = np.argwhere(mask)
    values = rng.choice(pool, size=indices.shape[0])
    weights = rng.uniform(0.25, 1.0, size=indices.shape[0])
    ids = sparse(indices, values, [rows, cols])
    return Case(ids, sparse(indices, weights, [rows, cols], tf.float32), ids), values.tolist()


def reference(case: Case, combiner: str | None) -> Result:
    if combiner is not None:
        return sparse_reference(case.ref_ids, case.weights, combiner)
    if isinstance(case.inputs, tf.RaggedTensor):
        return gather_reference(case.inputs)
    return keras_reference(case.inputs)


# (rows, cols, distinct ids) of the batches x and y of each step: the batch size, the
# width and the number of unique ids change, so the step retraces (reduce_retracing
# relaxes to a dynamic batch, then width) and a later batch reuses the first trace
# after a newer trace has replaced graph_rows
RETRACE_STEPS = [
    ((6, 3, 5), (4, 3, 4)),
    ((9, 3, 20), (6, 3, 1)),
    ((6, 3, 3), (4, 3, 4)),
    ((5, 2, 7), (3, 4, 2)),
]


@pytest.mark.parametrize(
    ("combiner", "kind", "words"),
    [
        (None, "dense", False),
        ("sum", "dense", True),
        ("mean", "ragged", True),
        ("sqrtn", "sparse", False),
    ],
    ids=["None-dense", "sum-dense-str", "mean-ragged-str", "sqrtn-sparse"],
)
def test_graph_retraces_keep_records_and_grads_paired(
    combiner: str | None, kind: str, words: bool
) -> None:
    """One tf.function(reduce_retracing=True) across batches of other sizes and other
    numbers of unique ids: each step's gradients pair with that step's ids."""
    layer, source = bound_layer(combiner)

    def forward(x: Any, y: Any, wx: Any, wy: Any) -> Any:
        a = layer(x, training=True) if wx is None else layer(x, sparse_weights=wx, training=True)
        b = layer(y, training=True) if wy is None else layer(y, sparse_weights=wy, training=True)
        return (a, b), weighted_sum(a) + 2.0 * weighted_sum(b)

    stepper = Stepper([layer], forward, "graph")
    traces = []
    for i, (x_shape, y_shape) in enumerate(RETRACE_STEPS):
        (x, x_ids), (y, y_ids) = (
            random_case(kind, *x_shape, 2 * i),
            random_case(kind, *y_shape, 2 * i + 1),
        )
        if words:
            inputs = (to_words(x.inputs), to_words(y.inputs))
            want_ids = [sorted({WORDS[j] for j in x_ids}), sorted({WORDS[j] for j in y_ids})]
        else:
            inputs = (x.inputs, y.inputs)
            want_ids = [sorted(set(x_ids)), sorted(set(y_ids))]
        before = len(source.requests)
        step = stepper(*inputs, x.weights, y.weights)
        traces.append(step.trace)
        assert [r.ids.tolist() for r in step.records] == want_ids, f"step {i}"
        assert [r.tolist() for r in source.requests[before:]] == want_ids, f"step {i}"
        ref_x, ref_y = reference(x, combiner), reference(y, combiner)
        assert_close(output_values(step.out[0]), output_values(ref_x.out))
        assert_close(output_values(step.out[1]), output_values(ref_y.out))
        assert_close(table_grad(source, step.records, step.grads), ref_x.grad + 2.0 * ref_y.grad)
    assert stepper.traces >= 2, f"the step never retraced: {traces}"
    assert any(t < max(traces[:i]) for i, t in enumerate(traces) if i), (
        f"no step ran an older trace after a newer one (stale graph_rows): {traces}"
    )
    assert set(source.training) == {True}


@pytest.mark.parametrize("combiner", ["mean"])
def test_a_step_over_ids_of_other_ranks_combines_the_last_axis(combiner: str, mode: str) -> None:
    layer, source = bound_layer(combiner)
    stepper = Stepper([layer], embed_and_sum(layer), mode)
    for kind in ("dense_1d", "dense_2d", "dense_3d"):
        case = combiner_case(kind)
        ids, _ = contributing(case.ref_ids, None, combiner)
        got = run_layer(layer, source, case.inputs, ids, mode, stepper=stepper)
        assert_matches(got, sparse_reference(case.ref_ids, None, combiner))


@pytest.mark.parametrize("combiner", COMBINERS)
def test_combiner_over_zero_width_ids_gives_zeros(combiner: str, mode: str) -> None:
    """A padded batch whose examples are all empty: (batch, 0) ids."""
    ids = np.zeros((3, 0), dtype=np.int64)
    layer, source = bound_layer(combiner)
    got = run_layer(layer, source, tf.constant(ids), [], mode)
    assert_matches(got, sparse_reference(dense_as_sparse(ids), None, combiner))
    assert not got.out.numpy().any()


def test_two_layers_on_one_table_in_one_model(mode: str) -> None:
    """Two layers of one table in a functional model: each records its own lookup and
    the trainer adds the gradients of an id both looked up."""
    source = MemorySource()
    user = DistributedEmbedding(TABLE, dim=DIM, name="user_emb")
    tags = DistributedEmbedding(TABLE, "mean", dim=DIM, padding_id=PAD, name="tags_emb")
    for layer in (user, tags):
        layer.bind(source)
    user_in = keras.Input((), dtype="int64", name="user")
    tags_in = keras.Input((None,), dtype="int64", name="tags")
    model = keras.Model(
        {"user": user_in, "tags": tags_in},
        keras.layers.Concatenate()([user(user_in), tags(tags_in)]),
    )
    stepper = Stepper([user, tags], lambda x: embed_and_sum(model)(x, training=True), mode)
    batches = [
        (np.array([4, 17, 4, 9]), DENSE_2D[:4]),  # 4 and 9 in both
        (np.array([5, 6, 12, 31, 1, 1]), np.concatenate([DENSE_2D, DENSE_2D[:1]])),
        (np.array([8, 2]), DENSE_2D[1:3]),  # row 0 is padding only
    ]
    for users, tag_ids in batches:
        before = len(source.requests)
        step = stepper({"user": tf.constant(users), "tags": tf.constant(tag_ids)})
        want_ids = [sorted(set(users.tolist())), sorted(set(tag_ids.ravel().tolist()) - {PAD})]
        assert [r.ids.tolist() for r in step.records] == want_ids
        assert [r.tolist() for r in source.requests[before:]] == want_ids

        var = tf.Variable(V)
        keep = tf.not_equal(dense_as_sparse(tag_ids).values, PAD)
        tag_sparse = tf.sparse.retain(dense_as_sparse(tag_ids), keep)
        with tf.GradientTape() as tape:
            ref = tf.concat(
                [
                    tf.gather(var, users),
                    tf.nn.safe_embedding_lookup_sparse(var, tag_sparse, None, combiner="mean"),
                ],
                axis=1,
            )
            ref_loss = weighted_sum(ref)
        assert_close(step.out.numpy(), ref.numpy())
        assert_close(
            table_grad(source, step.records, step.grads), dense_grad(tape.gradient(ref_loss, var))
        )
    assert set(source.training) == {True}
    if mode == "graph":
        assert stepper.traces == 2


# the inputs where the pruning of weights <= 0 (or == 0 for sum) and padding decide
# what is fetched
PRUNING_KINDS = ["sparse_zero_weights", "sparse_pruned"]
PADDING_KINDS = ["dense_2d", "ragged", "sparse_zero_weights", "sparse_pruned"]


def embed_each(layers: list[DistributedEmbedding]) -> Callable[..., Any]:
    """forward(xs, ws): layers[i] on xs[i] (with sparse_weights ws[i] if not None)."""

    def forward(xs: Any, ws: Any) -> Any:
        outs = tuple(
            layer(x, training=True) if w is None else layer(x, sparse_weights=w, training=True)
            for layer, x, w in zip(layers, xs, ws, strict=True)
        )
        return outs, tf.add_n([weighted_sum(o) for o in outs])

    return forward


@pytest.mark.parametrize(
    ("combiner", "padding"),
    [
        pytest.param(c, p, id=f"{c}-{'padding' if p else 'no-padding'}")
        for c in [None, *COMBINERS]
        for p in (False, True)
        if c or p  # combiner=None prunes nothing without padding
    ],
)
def test_graph_fetches_what_eager_fetches(combiner: str | None, padding: bool) -> None:
    """The padding and pruning rules are the same in both modes: for every input
    where they decide something (int ids; str ids with padding "") each layer's
    source gets the same requests, and the outputs and gradients agree. One step of
    one layer per input, so one trace."""
    cases = []  # (inputs, sparse weights, padding id, the requests the source must get)
    for kind in PADDING_KINDS if padding else PRUNING_KINDS:
        if combiner is None and kind.startswith("sparse"):
            continue  # a SparseTensor needs a combiner
        case = combiner_case(kind)
        ids, _ = contributing(case.ref_ids, case.weights, combiner, PAD if padding else None)
        cases.append((case.inputs, case.weights, PAD if padding else None, [sorted(set(ids))]))
        if padding and not kind.startswith("sparse"):
            vocab = ["", *WORDS[1:]]  # id PAD=0 becomes ""
            words = to_words(case.inputs, tf.constant(vocab))
            cases.append((words, case.weights, "", [sorted({vocab[i] for i in ids})]))
    inputs, weights, pads, want = (list(x) for x in zip(*cases, strict=True))

    steps, fetched = {}, {}
    for mode in MODES:
        bound = [bound_layer(combiner, padding_id=pad) for pad in pads]
        layers = [layer for layer, _ in bound]
        steps[mode] = Stepper(layers, embed_each(layers), mode)(tuple(inputs), tuple(weights))
        fetched[mode] = [[r.tolist() for r in source.requests] for _, source in bound]
        assert fetched[mode] == want, mode
    assert fetched["graph"] == fetched["eager"]
    for got, eager in zip(steps["graph"].out, steps["eager"].out, strict=True):
        assert_close(output_values(got), output_values(eager))
    for got, eager in zip(steps["graph"].grads, steps["eager"].grads, strict=True):
        assert_close(got, eager)


# ---------------------------------------- 7. keras integration and arguments


@pytest.mark.parametrize(
    ("combiner", "shape", "dtype", "ragged", "want"),
    [
        (None, (), "int64", False, (None, DIM)),
        (None, (3,), "int64", False, (None, 3, DIM)),
        (None, (2, 3), "int64", False, (None, 2, 3, DIM)),
        (None, (), "string", False, (None, DIM)),
        ("sum", (), "int64", False, (None, DIM)),
        ("mean", (3,), "int64", False, (None, DIM)),
        ("sqrtn", (2, 3), "int64", False, (None, 2, DIM)),
        ("mean", (None,), "string", True, (None, DIM)),
    ],
)
def test_functional_model_output_shape(
    combiner: str | None, shape: tuple[Any, ...], dtype: str, ragged: bool, want: tuple[Any, ...]
) -> None:
    # building needs no RowSource: an unbound layer would raise if it looked anything up
    layer = DistributedEmbedding(TABLE, combiner, dim=DIM)
    inputs = keras.Input(shape=shape, dtype=dtype, ragged=ragged)
    model = keras.Model(inputs, layer(inputs))
    assert tuple(model.output_shape) == want
    assert layer.compute_output_shape((None, *shape)) == want


def test_functional_model_runs_once_bound(mode: str) -> None:
    source = MemorySource()
    layer = DistributedEmbedding(TABLE, dim=DIM)
    layer.bind(source)
    inputs = keras.Input(shape=(), dtype="int64")
    model = keras.Model(inputs, layer(inputs))
    assert source.requests == [], "building the model must not call the store"
    ids = np.array([3, 1, 3, 49], dtype=np.int64)
    assert_close(run_in(mode, model, tf.constant(ids)).numpy(), V[ids])
    assert [r.tolist() for r in source.requests] == [[1, 3, 49]]


def test_training_flag_reaches_the_source(mode: str) -> None:
    layer, source = bound_layer()
    inputs = keras.Input(shape=(), dtype="int64")
    model = keras.Model(inputs, layer(inputs))
    ids = tf.constant([1, 2], tf.int64)

    def calls(x: Any) -> Any:
        layer(x)
        layer(x, training=True)
        model(x, training=True)
        model(x)
        model(x, training=False)  # as Trainer.evaluate
        return layer(x, training=False)

    run_in(mode, calls, ids)
    assert source.training == [False, True, True, False, False, False]

    # a training step's flag as a Python argument of the step: one trace per value
    stepper = Stepper([layer], lambda x, training: embed_and_sum(model)(x, training=training), mode)
    for training in (False, True, False, True):
        stepper(ids, training=training)
    assert source.training[6:] == [False, True, False, True]
    assert stepper.traces == (2 if mode == "graph" else 0)


def test_unbound_layer_raises_a_clear_error(mode: str) -> None:
    layer = DistributedEmbedding(TABLE, dim=DIM)
    with pytest.raises(RuntimeError) as excinfo:
        run_in(mode, layer, tf.constant([1, 2], tf.int64))
    assert "bind" in str(excinfo.value) and "Trainer" in str(excinfo.value)
    layer, _ = bound_layer()
    layer.bind(None)
    with pytest.raises(RuntimeError, match="bind"):
        run_in(mode, layer, tf.constant([1, 2], tf.int64))


SPEC = TableSpec(name=TABLE, dim=DIM, seed=1)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((TABLE,), {"dim": 0}, "dim"),
        ((TABLE,), {"dim": -3}, "dim"),
        ((TABLE,), {}, "dim"),
        ((TABLE,), {"dim": True}, "dim"),
        ((TABLE,), {"dim": 8.0}, "dim"),
        ((TABLE, "max"), {"dim": DIM}, "combiner"),
        ((TABLE, "MEAN"), {"dim": DIM}, "combiner"),
        ((SPEC,), {"dim": DIM + 1}, "dim"),
        (("",), {"dim": DIM}, "table"),
    ],
    ids=[
        "dim-0",
        "dim-negative",
        "dim-missing",
        "dim-bool",
        "dim-float",
        "combiner-max",
        "combiner-case",
        "tablespec-conflicting-dim",
        "table-empty",
    ],
)
def test_bad_arguments_raise_value_error(
    args: tuple[Any, ...], kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        DistributedEmbedding(*args, **kwargs)


def test_tablespec_gives_name_and_dim() -> None:
    for layer in (DistributedEmbedding(SPEC), DistributedEmbedding(SPEC, dim=DIM)):
        assert (layer.table, layer.dim) == (TABLE, DIM)


def bad_input(name: str) -> tuple[str | None, Any, dict[str, Any], str]:
    """(combiner, inputs, call kwargs, what the ValueError says) of a bad call."""
    case = combiner_case("sparse_weighted")
    if name == "sparse-without-combiner":
        return None, case.inputs, {"sparse_weights": case.weights}, "combiner"
    if name == "sparse_weights-with-dense-ids":
        return "mean", tf.constant(DENSE_2D), {"sparse_weights": case.weights}, "sparse_weights"
    if name == "sparse_weights-of-other-length":
        one = sparse([[0, 0]], [2.0], SPARSE_SHAPE, tf.float32)  # 1 weight for 10 ids
        return "sum", case.inputs, {"sparse_weights": one}, "sparse_weights"
    if name == "ragged_rank-2":
        return "mean", tf.ragged.constant([[[1], [2, 3]], []], dtype=tf.int64), {}, "ragged_rank"
    assert name == "combiner-on-scalar-ids"
    return "mean", tf.constant(3, tf.int64), {}, "1-D"


@pytest.mark.parametrize(
    ("name", "mode"),
    [
        pytest.param(
            name,
            mode,
            id=f"{mode}-{name}",
        )
        for name in [
            "sparse-without-combiner",
            "sparse_weights-with-dense-ids",
            "sparse_weights-of-other-length",
            "ragged_rank-2",
            "combiner-on-scalar-ids",
        ]
        for mode in MODES
    ],
)
def test_bad_inputs_raise_value_error_before_any_lookup(name: str, mode: str) -> None:
    combiner, inputs, kwargs, match = bad_input(name)
    layer, source = bound_layer(combiner)
    # In a tf.function the number of sparse values is known only when it runs: there
    # the ValueError may come out of the py_function as an OpError with its message.
    runtime_only = mode == "graph" and name == "sparse_weights-of-other-length"
    errors = (ValueError, tf.errors.OpError) if runtime_only else ValueError
    with pytest.raises(errors, match=match):
        run_in(mode, lambda x, kw: layer(x, **kw), inputs, kwargs)
    assert source.requests == []


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"combiner": "sqrtn", "padding_id": 0, "feature": "tags", "name": "tags_emb"},
        {"combiner": "mean", "padding_id": ""},
    ],
    ids=["defaults", "int-padding", "str-padding"],
)
def test_get_config_round_trips(kwargs: dict[str, Any]) -> None:
    layer = DistributedEmbedding(TABLE, dim=DIM, **kwargs)
    config = layer.get_config()
    json.dumps(config)  # a saved model stores it as JSON
    clone = DistributedEmbedding.from_config(config)
    assert clone.get_config() == config
    for attr in ("table", "dim", "combiner", "padding_id", "feature", "name"):
        assert getattr(clone, attr) == getattr(layer, attr), attr
    assert DistributedEmbedding.from_config(DistributedEmbedding(SPEC).get_config()).dim == DIM
