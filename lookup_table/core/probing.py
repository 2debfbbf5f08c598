"""Open-addressing probes of the row cache's maps, compiled (numba): pure, no I/O.

A map (`lookup_table.core.rowcache._IntMap`) keys a slot by a 16-byte row of `meta`: the
id, then the table number (low 32 bits) with a *used* and a *valid* flag; linear probing
from a position mixed from (id, table number), at most `MAX_PROBES` slots, no deletions.
Compiled, a batch's keys are found in one pass, where numpy needs a pass over the whole
batch per probe step. The puts append the slots they make dirty to the map's record of
them, which `dirty_slots` reads back in slot order (no scan of the map's stamps). Only
integer work happens here, so the result is the same on every CPU.
"""

from __future__ import annotations

import numpy as np
from numba import types

from lookup_table.core.hashing import mix64_one
from lookup_table.core.jit import PREFETCH_AHEAD, compiled, prefetch_head, prefetch_row

__all__ = [
    "MAX_PROBES",
    "TAB_BITS",
    "USED",
    "VALID",
    "clean",
    "dirty_slots",
    "find",
    "find_known",
    "gather",
    "gather_to",
    "scatter",
    "stamped",
    "upsert",
]

MAX_PROBES = 64  # at load <= 1/2 a probe sequence this long is vanishingly rare
TAB_BITS = 0xFFFFFFFF  # a key row's second word: the table number in the low 32 bits
USED = 1 << 32  # the slot holds a key
VALID = 1 << 33  # its value is known (unset: forgotten)

_MATCH = np.int64(TAB_BITS | USED)
_USED = np.int64(USED)
_VALID = np.int64(VALID)
_SALT = np.uint64(0x9E3779B97F4A7C15)  # the table number's, mixed into the position
# the index of a 64-bit word's only set bit, from the top 6 bits of it times the constant
_DE_BRUIJN = np.uint64(0x03F79D71B4CB0A89)
_DE_BRUIJN_INDEX = np.zeros(64, dtype=np.int64)
for _bit in range(64):
    _DE_BRUIJN_INDEX[((1 << _bit) * 0x03F79D71B4CB0A89 % (1 << 64)) >> 58] = _bit


_ids = types.Array(types.int64, 1, "A", readonly=True)
_tabs = types.Array(types.int32, 1, "A", readonly=True)
_meta = types.Array(types.int64, 2, "C")
_slots = types.Array(types.intp, 1, "C")
_PAIR = types.UniTuple(types.intp, 2)  # type: ignore[no-untyped-call]


@compiled(types.intp(types.int64, types.int32, types.intp))
def _position(key, tab, mask):  # type: ignore[no-untyped-def]  # pragma: no cover
    z = mix64_one(np.uint64(key) ^ (np.uint64(tab) * _SALT))  # splitmix64's finalizer
    return np.intp(z & np.uint64(mask))


@compiled(types.void(_meta, types.intp, _ids, _tabs, _slots))
def find(meta, mask, ids, tabs, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """`out[i]`: the slot holding (ids[i], tabs[i]), -1 where absent (a free slot, or
    `MAX_PROBES` slots without it, ends the search)."""
    n = ids.shape[0]
    for i in range(n):
        if i + PREFETCH_AHEAD < n:  # the slot a later key's probes start at
            k = i + PREFETCH_AHEAD
            prefetch_row(meta, _position(ids[k], tabs[k], mask))
        key = ids[i]
        want = np.int64(tabs[i]) | _USED
        p = _position(key, tabs[i], mask)
        out[i] = -1
        for _ in range(MAX_PROBES):
            word = meta[p, 1]
            if (word & _USED) == 0:
                break
            if meta[p, 0] == key and (word & _MATCH) == want:
                out[i] = p
                break
            p = (p + 1) & mask


@compiled(
    types.UniTuple(types.intp, 3)(  # type: ignore[no-untyped-call]
        _meta,
        types.intp,
        types.Array(types.float32, 2, "C"),
        types.Array(types.int64, 1, "C"),
        _ids,
        _tabs,
        types.Array(types.float32, 2, "A", readonly=True),
        types.Array(types.int64, 1, "A", readonly=True),
        types.boolean,
        types.Array(types.bool_, 1, "C"),
        _slots,
        types.intp,
        types.int64,
    )
)
def upsert(  # type: ignore[no-untyped-def]  # pragma: no cover - compiled
    meta, mask, values, stamps, ids, tabs, src, each, keep, placed, record, logged, since
):
    """`scatter` for the keys the map holds (none changed where `keep`); the others
    take the first free slot of their probe sequences, with the used and valid flags.
    One probe sequence per key: the key's slot or the first free one ends it.
    `placed[i]` False where neither came within `MAX_PROBES` slots. A slot given a
    dirty stamp (> 0) is appended to `record` after its first `logged` entries (room
    for every key: the caller's). Returns how many were inserted, the record's new
    length and how many held slots were dirty with a stamp > `since` before."""
    count = 0
    again = 0
    width = values.shape[1]
    n = ids.shape[0]
    for i in range(n):
        if i + PREFETCH_AHEAD < n:  # where a later key most likely is, or will go
            ahead = _position(ids[i + PREFETCH_AHEAD], tabs[i + PREFETCH_AHEAD], mask)
            prefetch_row(meta, ahead)
            prefetch_row(values, ahead)
            prefetch_row(stamps, ahead)
        key = ids[i]
        want = np.int64(tabs[i]) | _USED
        p = _position(key, tabs[i], mask)
        placed[i] = False
        for _ in range(MAX_PROBES):
            word = meta[p, 1]
            free = (word & _USED) == 0
            if free or (meta[p, 0] == key and (word & _MATCH) == want):
                placed[i] = True
                if free:
                    meta[p, 0] = key
                    meta[p, 1] = want | _VALID
                    count += 1
                elif keep:
                    break
                else:
                    meta[p, 1] = word | _VALID
                    if stamps[p] > since:
                        again += 1
                for j in range(width):
                    values[p, j] = src[i, j]
                if stamps[p] <= 0 and each[i] > 0:  # a free slot's stamp is 0
                    record[logged] = p
                    logged += 1
                stamps[p] = each[i]
                break
            p = (p + 1) & mask
    return count, logged, again


@compiled(types.void(_meta, types.intp, _ids, _tabs, _slots, types.Array(types.bool_, 1, "C")))
def find_known(meta, mask, ids, tabs, out, known):  # type: ignore[no-untyped-def]  # pragma: no cover
    """`find`, and whether each found slot's value is known (`known[i]`; False where
    absent)."""
    find(meta, mask, ids, tabs, out)
    for i in range(ids.shape[0]):
        p = out[i]
        known[i] = p >= 0 and (meta[p, 1] & _VALID) != 0


@compiled(
    types.void(
        types.Array(types.float32, 2, "C", readonly=True),
        types.Array(types.int64, 1, "C", readonly=True),
        _slots,
        types.Array(types.float32, 2, "C"),
        types.Array(types.int64, 1, "C"),
    )
)
def gather(values, stamps, slots, out, out_stamps):  # type: ignore[no-untyped-def]  # pragma: no cover
    """`out[i]` and `out_stamps[i]`: the value (its first `out.shape[1]` floats) and
    stamp of slot `slots[i]` (numpy's take, with the rows a few slots ahead asked for
    early: `jit.prefetch_row`, of the floats wanted only)."""
    n = slots.shape[0]
    width = out.shape[1]
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            prefetch_head(values, slots[i + PREFETCH_AHEAD], 4 * width)
            prefetch_row(stamps, slots[i + PREFETCH_AHEAD])
        p = slots[i]
        row = values[p]
        o = out[i]
        for j in range(width):
            o[j] = row[j]
        out_stamps[i] = stamps[p]


@compiled(
    types.void(
        types.Array(types.float32, 2, "C", readonly=True),
        _slots,
        types.Array(types.intp, 1, "C", readonly=True),
        types.Array(types.float32, 2, "C"),
    )
)
def gather_to(values, slots, dest, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """`out[dest[i]]`: the value of slot `slots[i]` (slots ascending: the map is read in
    order, and each `out` row is written once wherever the caller wants it)."""
    n = slots.shape[0]
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            prefetch_row(values, slots[i + PREFETCH_AHEAD])
        row = values[slots[i]]
        o = out[dest[i]]
        for j in range(row.shape[0]):
            o[j] = row[j]


@compiled(
    types.void(
        types.Array(types.int64, 1, "C", readonly=True),
        _slots,
        types.Array(types.bool_, 1, "C", readonly=True),
        types.int64,
        types.Array(types.bool_, 1, "C"),
    )
)
def stamped(stamps, slots, hit, stamp, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """`out[i]`: whether `hit[i]` and slot `slots[i]` has the stamp `stamp` (numpy's
    take and compare, with the stamps ahead asked for early)."""
    n = slots.shape[0]
    for i in range(n):
        if i + PREFETCH_AHEAD < n and hit[i + PREFETCH_AHEAD]:
            prefetch_row(stamps, slots[i + PREFETCH_AHEAD])
        out[i] = hit[i] and stamps[slots[i]] == stamp


@compiled(
    _PAIR(
        _meta,
        types.Array(types.float32, 2, "C"),
        types.Array(types.int64, 1, "C"),
        _slots,
        types.Array(types.float32, 2, "A", readonly=True),
        types.Array(types.int64, 1, "A", readonly=True),
        _slots,
        types.intp,
        types.int64,
    )
)
def scatter(meta, values, stamps, slots, src, each, record, logged, since):  # type: ignore[no-untyped-def]  # pragma: no cover
    """Slot `slots[i]` takes the value `src[i]` and the stamp `each[i]`, and is known
    (valid) from now on (numpy's fancy assignment, with rows ahead asked for early). A
    slot made dirty (its stamp was <= 0, now > 0) is appended to `record` after its first
    `logged` entries (room for every slot: the caller's). Returns the record's new length
    and how many slots were dirty with a stamp > `since` before."""
    again = 0
    n = slots.shape[0]
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            ahead = slots[i + PREFETCH_AHEAD]
            prefetch_row(values, ahead)
            prefetch_row(meta, ahead)
            prefetch_row(stamps, ahead)
        p = slots[i]
        row = values[p]
        for j in range(row.shape[0]):
            row[j] = src[i, j]
        meta[p, 1] |= _VALID
        before = stamps[p]
        if before > since:
            again += 1
        if before <= 0 and each[i] > 0:
            record[logged] = p
            logged += 1
        stamps[p] = each[i]
    return logged, again


@compiled(
    types.intp(
        _meta,
        types.Array(types.int64, 1, "C", readonly=True),
        types.Array(types.intp, 1, "C", readonly=True),
        types.Array(types.uint64, 1, "C"),
        _slots,
    )
)
def dirty_slots(meta, stamps, record, bits, out):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The slots of `record` whose stamp is > 0 (dirty) and whose value is known, once
    each, in slot order, into `out` (as long as `record`); returns how many. `bits`: one
    zeroed bit per slot of the map (a record's slots are marked there, then the marks
    are read in order: no sort)."""
    for i in range(record.shape[0]):
        p = record[i]
        bits[p >> 6] |= np.uint64(1) << np.uint64(p & 63)
    count = 0
    for w in range(bits.shape[0]):
        word = bits[w]
        while word:
            low = word & (~word + np.uint64(1))  # the lowest mark: its index by de Bruijn
            p = (w << 6) + _DE_BRUIJN_INDEX[(low * _DE_BRUIJN) >> np.uint64(58)]
            if stamps[p] > 0 and (meta[p, 1] & _VALID) != 0:
                out[count] = p
                count += 1
            word ^= low
    return count


@compiled(types.intp(types.Array(types.int64, 1, "C"), _slots, types.intp, types.int64))
def clean(stamps, record, logged, upto):  # type: ignore[no-untyped-def]  # pragma: no cover
    """The stamps in 1..`upto` (dirty entries put by then) of the first `logged` slots of
    `record` become 0 (clean); the slots still dirty are kept at the record's front, in
    order. Returns how many."""
    kept = 0
    for i in range(logged):
        p = record[i]
        s = stamps[p]
        if 0 < s <= upto:
            stamps[p] = 0
        elif s > 0:
            record[kept] = p
            kept += 1
    return kept
