"""encode_items / decode_items (lookup_table.core.optimizers.layout) against coding each
part of an item with `precision.encode` / `decode` on its own: the same bytes, the same
items back and the same errors, for every optimizer, row dtype and rounding."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray

from lookup_table.config import (
    AdagradConfig,
    AdamConfig,
    RowwiseAdagradConfig,
    RowwiseAdamConfig,
    SGDConfig,
)
from lookup_table.core.optimizers import Optimizer, make_optimizer
from lookup_table.core.optimizers.layout import decode_items, encode_items, item_layout
from lookup_table.core.precision import (
    ROUNDINGS,
    ROW_DTYPES,
    decode,
    encode,
    itemsize,
    rounding_keys,
)
from lookup_table.errors import ConfigError, RowOverflowError

pytestmark = pytest.mark.unit

OPTIMIZERS = {
    "adam": AdamConfig(),
    "sgd": SGDConfig(),
    "sgd-momentum": SGDConfig(momentum=0.9),
    "adagrad": AdagradConfig(),
    "rowwise_adagrad": RowwiseAdagradConfig(),
    "rowwise_adam": RowwiseAdamConfig(),
    "rowwise_adam-f32": RowwiseAdamConfig(momentum_dtype="float32"),
}


def _encode_per_part(
    items: NDArray[np.float32], opt: Optimizer, dim: int, dtype: Any, **row: Any
) -> NDArray[np.uint8]:
    """Each part with `precision.encode`: the row with `row`'s rounding, slots to nearest."""
    table, ids = row.pop("table", "rows"), row.get("ids")
    out = []
    column = 0
    for part in item_layout(opt, dim, dtype):
        values = items[:, column : column + part.width]
        if part.name == "row":
            words = encode(values, part.dtype, table=table, **row)
        else:
            words = encode(values, part.dtype, table=f"{table} {part.name}", ids=ids)
        out.append(words.view(np.uint8).reshape(items.shape[0], -1))
        column += part.width
    return np.concatenate(out, axis=1)


def _decode_per_part(
    stored: NDArray[np.uint8], opt: Optimizer, dim: int, dtype: Any
) -> NDArray[np.float32]:
    out = []
    offset = 0
    for part in item_layout(opt, dim, dtype):
        nbytes = part.width * itemsize(part.dtype)
        raw = np.ascontiguousarray(stored[:, offset : offset + nbytes])
        word = np.dtype("<f4") if part.dtype == "float32" else np.dtype("<u2")
        out.append(decode(raw.view(word).reshape(stored.shape[0], part.width), part.dtype))
        offset += nbytes
    return np.concatenate(out, axis=1)


# float32 bits of the cases rounding is made of: signed zeros, float32 and float16
# subnormals, float16's largest and its halfway points, bfloat16 halfway points, NaNs
_SPECIAL = [
    0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x33000000, 0x33000001, 0xB3800000,
    0x387FC000, 0x38800000, 0x477FE000, 0xC77FE000, 0x477FDFFF, 0x3F801000, 0x3F803000,
    0x3F808000, 0x3F818000, 0xBF80FFFF, 0x7F7F0000, 0xFF7E8000, 0x7FC00000, 0xFFC00001, 0x7F800001,
    0x7FBFFFFF, 0x3C00F000, 0x34FFFFFF,
]  # fmt: skip


def _values(n: int, width: int, rng: np.random.Generator, *, f16_range: bool) -> Any:
    """Random values of every scale the dtype holds, with the special cases mixed in."""
    scale = 10.0 ** rng.integers(-9 if f16_range else -44, 5 if f16_range else 38, (n, width))
    values = (rng.standard_normal((n, width)) * scale).astype(np.float32)
    limit = 65504.0 if f16_range else 3.3e38
    values = np.clip(values, -limit, limit)
    special = np.array(_SPECIAL, dtype=np.uint32).view(np.float32)
    if f16_range:
        special = special[~(np.abs(special) > 65504)]
    where = rng.random((n, width)) < 0.2
    values[where] = rng.choice(special, int(where.sum()))
    return values


@pytest.mark.parametrize("case", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", ROW_DTYPES)
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("dim", [1, 5, 16, 33])
def test_items_are_coded_as_each_part_is_on_its_own(
    case: str, dtype: Any, rounding: Any, dim: int
) -> None:
    opt = make_optimizer(OPTIMIZERS[case])
    rng = np.random.default_rng(dim * 31 + len(case))
    n = 200
    layout = item_layout(opt, dim, dtype)
    parts = [_values(n, p.width, rng, f16_range=p.dtype == "float16") for p in layout]
    items = np.concatenate(parts, axis=1)
    keys = rounding_keys(7, rng.integers(0, 2**63, n, dtype=np.uint64), 3)
    got = encode_items(items, opt, dim, dtype, rounding=rounding, keys=keys)
    want = _encode_per_part(items, opt, dim, dtype, rounding=rounding, keys=keys)
    assert got.dtype == np.uint8 and got.shape == want.shape
    assert got.tobytes() == want.tobytes()
    frozen = got.copy()
    frozen.flags.writeable = False
    for stored in (got, frozen, np.pad(got, ((0, 0), (1, 0)))[:, 1:]):  # unaligned too
        back = decode_items(stored, opt, dim, dtype)
        assert back.tobytes() == _decode_per_part(got, opt, dim, dtype).tobytes()
    strided = np.zeros((n, 2 * items.shape[1]), np.float32)
    strided[:, ::2] = items
    again = encode_items(strided[:, ::2], opt, dim, dtype, rounding=rounding, keys=keys)
    assert again.tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_float16_and_bfloat16_word_decodes_as_on_its_own(dtype: Any) -> None:
    """All 65536 words in every 16-bit part, NaN payloads and infs too."""
    opt = make_optimizer(RowwiseAdamConfig())
    words = np.arange(2**16, dtype=np.uint32).astype(np.uint16).reshape(-1, 16)
    n = words.shape[0]
    tail = np.zeros((n, 2), np.float32).view(np.uint16)  # v and step, float32
    stored = np.concatenate([words, words, tail], axis=1).view(np.uint8)
    assert decode_items(stored, opt, 16, dtype).tobytes() == (
        _decode_per_part(stored, opt, 16, dtype).tobytes()
    )


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_a_value_beyond_its_dtype_is_refused_as_on_its_own(rounding: Any) -> None:
    """The first part with a value beyond its dtype names it: the same RowOverflowError
    (message, table, value) as coding that part alone, and no bytes."""
    rng = np.random.default_rng(9)
    keys = rounding_keys(1, np.arange(8, dtype=np.uint64), 0)
    ids = np.arange(100, 108)
    for config, dtype, column, value in (
        (RowwiseAdamConfig(), "float16", 2, 70000.0),  # the row
        (RowwiseAdamConfig(), "float16", 5, np.inf),  # m: the row's 1e6 is named first
        (RowwiseAdamConfig(), "float32", 6, 3.4e38),  # m, bfloat16
        (AdamConfig(), "bfloat16", 3, -np.inf),
        (SGDConfig(), "float16", 0, -65520.0),
    ):
        opt = make_optimizer(config)
        items = rng.standard_normal((8, 4 + opt.slot_width(4))).astype(np.float32)
        items[:, 4:] = np.abs(items[:, 4:])
        items[5, column] = value
        items[6, 3] = 1e6  # beyond float16 only, a row later
        with pytest.raises(RowOverflowError) as want:
            _encode_per_part(items, opt, 4, dtype, rounding=rounding, keys=keys, ids=ids)
        with pytest.raises(RowOverflowError) as got:
            encode_items(items, opt, 4, dtype, rounding=rounding, keys=keys, ids=ids)
        assert str(got.value) == str(want.value)
        assert (got.value.table, got.value.dtype) == (want.value.table, want.value.dtype)
        assert ("row 6, column 3" in str(got.value)) == (dtype == "float16" and column >= 4)


def test_bad_rounding_and_keys_say_what_is_wrong() -> None:
    opt = make_optimizer(RowwiseAdamConfig())
    items = np.zeros((3, 4 + opt.slot_width(4)), np.float32)
    with pytest.raises(ConfigError, match="rounding 'up' is not one of nearest, stochastic"):
        encode_items(items, opt, 4, "float16", rounding="up")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"one uint64 key per row \(3,\) .* got None"):
        encode_items(items, opt, 4, "float16", rounding="stochastic")
    with pytest.raises(ValueError, match=r"got uint64 \(2,\)"):
        encode_items(items, opt, 4, "bfloat16", rounding="stochastic",
                     keys=np.zeros(2, np.uint64))  # fmt: skip
    # a float32 row takes no keys: its slots round to nearest
    stored = encode_items(items, opt, 4, "float32", rounding="stochastic")
    assert stored.shape == (3, 16 + 8 + 8)
