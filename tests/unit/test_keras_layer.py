"""`DistributedEmbedding` (lookup_table.keras) against references we did not write.

On the same table values the layer must compute what `keras.layers.Embedding`
computes (combiner=None) and what `tf.nn.safe_embedding_lookup_sparse` computes
(combiners), forward and backward: the gradients the trainer reads from the
recorded rows tensors, scattered to their ids' rows, must be the gradient of the
same loss w.r.t. the reference's table, and zero wherever the layer recorded no id.

The rows come from `MemorySource`, an in-memory `RowSource` (the store has its
own tests; this is the layer's math). It records every request, so each test
also checks that a call asks for its unique contributing ids exactly once.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
tf = pytest.importorskip("tensorflow", reason="tensorflow is not importable: the layer needs it")
keras = pytest.importorskip("keras", reason="keras is not importable: the layer needs it")

from lookup_table.config import TableSpec  # noqa: E402
from lookup_table.keras import DistributedEmbedding  # noqa: E402

pytestmark = pytest.mark.unit

DIM = 8
VOCAB = 50
ATOL = 1e-6
TABLE = "emb"
PAD = 0
COMBINERS = ["sum", "mean", "sqrtn"]

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


# ---------------------------------------- running and comparing


@dataclass
class Result:
    out: Any  # tf.Tensor, or tf.RaggedTensor
    grad: NDArray[np.float32]  # (VOCAB, DIM): d loss / d table row
    fetched: NDArray[np.bool_] | None = None  # (VOCAB,): rows the layer looked up


def loss_weights(shape: Any) -> Any:
    """Fixed random weights W of loss = sum(out * W): every output element matters."""
    values = np.random.default_rng(99).uniform(-1.0, 1.0, size=tuple(shape))
    return tf.constant(values.astype(np.float32))


def weighted_sum(out: Any) -> Any:
    values = out.flat_values if isinstance(out, tf.RaggedTensor) else out
    return tf.reduce_sum(values * loss_weights(values.shape))


def dense_grad(grad: Any) -> NDArray[np.float32]:
    assert grad is not None, "the loss does not depend on the rows"
    return np.asarray(tf.convert_to_tensor(grad).numpy())


def run_layer(
    layer: DistributedEmbedding, source: MemorySource, inputs: Any, ids: list[Any], **kwargs: Any
) -> Result:
    """One training step's worth: output and table gradient, as the trainer computes them.

    `ids` are the ids that must reach the source (with repeats): one request, of
    their unique values, recorded with the watched rows tensor.
    """
    before = len(source.requests)
    with tf.GradientTape() as tape:
        layer.begin_step(tape)
        out = layer(inputs, **kwargs)
        loss = weighted_sum(out)
    records = list(layer.records)
    grads = tape.gradient(loss, [r.rows for r in records])
    layer.begin_step(None)
    requests = source.requests[before:]
    assert len(requests) == 1, f"one call must look its ids up once, got {len(requests)}"
    assert len(records) == 1, f"one call must record one lookup, got {len(records)}"
    request, record = requests[0].tolist(), records[0]
    assert len(set(request)) == len(request), f"an id was requested twice: {request}"
    assert sorted(request) == sorted(set(ids))
    assert record.table == TABLE
    assert record.ids.tolist() == request, "the recorded ids are the fetched ids"
    fetched = np.zeros(VOCAB, dtype=bool)
    fetched[source.row_index(record.ids)] = True
    return Result(out, table_grad(source, records, grads), fetched)


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
def test_matches_keras_embedding(shape: tuple[int, ...]) -> None:
    ids = int_ids(shape, seed=len(shape))
    layer, source = bound_layer()
    got = run_layer(layer, source, tf.constant(ids), ids.reshape(-1).tolist())
    assert tuple(got.out.shape) == (*shape, DIM)
    assert_matches(got, keras_reference(tf.constant(ids)))


def test_two_calls_in_one_step_record_two_lookups() -> None:
    a, b = int_ids((5, 3), seed=1), int_ids((4,), seed=2)
    b[0] = a[0, 0]  # an id in both calls: the trainer adds its two gradients
    layer, source = bound_layer()
    with tf.GradientTape() as tape:
        layer.begin_step(tape)
        loss = weighted_sum(layer(tf.constant(a))) + 2.0 * weighted_sum(layer(tf.constant(b)))
    grads = tape.gradient(loss, [r.rows for r in layer.records])
    assert [r.ids.tolist() for r in layer.records] == [sorted(set(a.ravel())), sorted(set(b))]
    assert [r.tolist() for r in source.requests] == [r.ids.tolist() for r in layer.records]

    emb = keras.layers.Embedding(VOCAB, DIM)
    emb.build(None)
    emb.embeddings.assign(V)
    with tf.GradientTape() as tape:
        ref_loss = weighted_sum(emb(tf.constant(a))) + 2.0 * weighted_sum(emb(tf.constant(b)))
    want = dense_grad(tape.gradient(ref_loss, emb.embeddings))
    assert_close(table_grad(source, layer.records, grads), want)
    assert_close(float(loss), float(ref_loss), atol=1e-5)  # a sum of ~50 terms of size ~1

    layer.begin_step(None)
    assert layer.records == []
    layer(tf.constant(a))
    assert layer.records == [], "no tape, nothing recorded"


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
def test_padding_without_combiner_is_a_zero_vector(shape: tuple[int, ...]) -> None:
    ids = int_ids(shape, seed=7)
    ids.reshape(-1)[[0, 2, -1]] = PAD
    layer, source = bound_layer(padding_id=PAD)
    got = run_layer(layer, source, tf.constant(ids), [i for i in ids.ravel() if i != PAD])
    assert not np.any(got.out.numpy()[ids == PAD]), "padded positions must be zero vectors"
    # keras.layers.Embedding on a table whose padding row is zero
    assert_matches(got, without_pad_grad(keras_reference(tf.constant(ids), padded_table())))


def test_padding_without_combiner_ragged() -> None:
    ids = tf.ragged.constant([[PAD, 4, 9], [], [PAD], [5, PAD, 5]], dtype=tf.int64)
    layer, source = bound_layer(padding_id=PAD)
    got = run_layer(layer, source, ids, [4, 9, 5])
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
def test_combiner_matches_safe_embedding_lookup_sparse(combiner: str, kind: str) -> None:
    case = combiner_case(kind)
    layer, source = bound_layer(combiner)
    kwargs = {} if case.weights is None else {"sparse_weights": case.weights}
    ids, nonempty = contributing(case.ref_ids, case.weights, combiner)
    got = run_layer(layer, source, case.inputs, ids, **kwargs)
    assert_matches(got, sparse_reference(case.ref_ids, case.weights, combiner))
    assert not np.any(got.out.numpy()[~nonempty]), "a row with no ids must be zeros"
    if kind in ("ragged", "sparse", "sparse_zero_weights"):
        assert not nonempty.all(), "the case must have an empty row"


@pytest.mark.parametrize(
    "kind", ["dense_1d", "dense_2d", "dense_3d", "ragged", "sparse_zero_weights"]
)
@pytest.mark.parametrize("combiner", COMBINERS)
def test_padding_is_excluded_from_combiners(combiner: str, kind: str) -> None:
    case = combiner_case(kind)
    layer, source = bound_layer(combiner, padding_id=PAD)
    kwargs = {} if case.weights is None else {"sparse_weights": case.weights}
    ids, nonempty = contributing(case.ref_ids, case.weights, combiner, padding_id=PAD)
    assert PAD in case.ref_ids.values.numpy().tolist() and PAD not in ids
    got = run_layer(layer, source, case.inputs, ids, **kwargs)
    # the reference gets the SparseTensor of the non-padding positions
    keep = tf.not_equal(case.ref_ids.values, PAD)
    ref_ids = tf.sparse.retain(case.ref_ids, keep)
    ref_weights = None if case.weights is None else tf.sparse.retain(case.weights, keep)
    assert_matches(got, sparse_reference(ref_ids, ref_weights, combiner))
    assert not np.any(got.out.numpy()[~nonempty]), "a row of padding only must be zeros"


def test_negative_ids_are_real_ids() -> None:
    """Unlike safe_embedding_lookup_sparse, a negative id is an id: -25 is row 0 here."""
    offset = 25
    source = MemorySource(offset=offset)
    ids = int_ids((4, 3), seed=5) - offset
    assert (ids < 0).any()
    layer, _ = bound_layer(source=source)
    got = run_layer(layer, source, tf.constant(ids), ids.ravel().tolist())
    assert_matches(got, keras_reference(tf.constant(ids + offset)))

    layer, _ = bound_layer("mean", source=source)
    sp = dense_as_sparse(ids)
    got = run_layer(layer, source, sp, ids.ravel().tolist())
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
def test_string_ids_match_int_ids(combiner: str | None, kind: str) -> None:
    case = combiner_case(kind)
    kwargs = {} if case.weights is None else {"sparse_weights": case.weights}
    ids, _ = contributing(case.ref_ids, case.weights, combiner)
    int_layer, int_source = bound_layer(combiner)
    want = run_layer(int_layer, int_source, case.inputs, ids, **kwargs)
    str_layer, str_source = bound_layer(combiner)
    words = to_words(case.inputs)
    assert words.dtype == tf.string
    got = run_layer(str_layer, str_source, words, [WORDS[i] for i in ids], **kwargs)
    assert_matches(got, want)


@pytest.mark.parametrize("kind", ["dense_2d", "ragged"])
@pytest.mark.parametrize("combiner", [None, "mean"])
def test_string_padding(combiner: str | None, kind: str) -> None:
    case = combiner_case(kind)
    ids, _ = contributing(case.ref_ids, None, combiner, padding_id=PAD)
    int_layer, int_source = bound_layer(combiner, padding_id=PAD)
    want = run_layer(int_layer, int_source, case.inputs, ids)
    str_layer, str_source = bound_layer(combiner, padding_id="")
    words = to_words(case.inputs, tf.constant(["", *WORDS[1:]]))  # id PAD=0 becomes ""
    got = run_layer(str_layer, str_source, words, [WORDS[i] for i in ids])
    assert_matches(got, want)


# ---------------------------------------- 5. ragged, combiner=None


def test_ragged_without_combiner_is_a_ragged_gather() -> None:
    ids = tf.ragged.constant(RAGGED, dtype=tf.int64)
    layer, source = bound_layer()
    got = run_layer(layer, source, ids, [i for row in RAGGED for i in row])
    assert isinstance(got.out, tf.RaggedTensor)
    assert got.out.shape.as_list() == [len(RAGGED), None, DIM]
    for out_row, row in zip(got.out, RAGGED, strict=True):
        assert_close(out_row.numpy(), V[np.array(row, dtype=np.int64)])
    assert_matches(got, gather_reference(ids))


# ---------------------------------------- 6. keras integration and arguments


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


def test_functional_model_runs_once_bound() -> None:
    source = MemorySource()
    layer = DistributedEmbedding(TABLE, dim=DIM)
    layer.bind(source)
    inputs = keras.Input(shape=(), dtype="int64")
    model = keras.Model(inputs, layer(inputs))
    assert source.requests == [], "building the model must not call the store"
    ids = np.array([3, 1, 3, 49], dtype=np.int64)
    assert_close(model(tf.constant(ids)).numpy(), V[ids])
    assert [r.tolist() for r in source.requests] == [[1, 3, 49]]


def test_training_flag_reaches_the_source() -> None:
    layer, source = bound_layer()
    inputs = keras.Input(shape=(), dtype="int64")
    model = keras.Model(inputs, layer(inputs))
    ids = tf.constant([1, 2], tf.int64)
    layer(ids)
    layer(ids, training=True)
    model(ids, training=True)
    model(ids)
    assert source.training == [False, True, True, False]


def test_unbound_layer_raises_a_clear_error() -> None:
    layer = DistributedEmbedding(TABLE, dim=DIM)
    with pytest.raises(RuntimeError) as excinfo:
        layer(tf.constant([1, 2], tf.int64))
    assert "bind" in str(excinfo.value) and "Trainer" in str(excinfo.value)
    layer, _ = bound_layer()
    layer.bind(None)
    with pytest.raises(RuntimeError, match="bind"):
        layer(tf.constant([1, 2], tf.int64))


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


def test_bad_inputs_raise_value_error_before_any_lookup() -> None:
    layer, source = bound_layer()
    case = combiner_case("sparse_weighted")
    with pytest.raises(ValueError, match="combiner"):
        layer(case.inputs)
    mean, _ = bound_layer("mean", source=source)
    with pytest.raises(ValueError, match="sparse_weights"):
        mean(tf.constant(DENSE_2D), sparse_weights=case.weights)
    with pytest.raises(ValueError, match="ragged_rank"):
        mean(tf.ragged.constant([[[1], [2, 3]], []], dtype=tf.int64))
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
