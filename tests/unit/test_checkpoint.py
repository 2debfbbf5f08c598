"""The pure parts of `lookup_table.ops.checkpoint`: id packing, key parsing, names, manifests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lookup_table import CheckpointError, StoreError
from lookup_table.core.keys import decode_key, encode_key, encode_keys
from lookup_table.ops.checkpoint import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    check_compatible,
    decode_bodies,
    decode_int_bodies,
    dense_file_stems,
    finalize,
    pack_str_ids,
    parse_metadump,
    unpack_str_ids,
    verify_checkpoint,
)
from tests.conftest import make_config
from tests.strategies import INT64_MAX, INT64_MIN, int_ids, str_id_lists

pytestmark = pytest.mark.unit

TRICKY_IDS = [
    "a b",
    "x/y",
    "ünï",
    "日本",
    "nul\x00",
    "\x00",
    "",
    "100%",
    "tab\t",
    "new\nline",
    "😀",
]


# ---------------------------------------------------------------- string ids


@given(str_id_lists())
def test_str_ids_round_trip_exactly(ids: list[str]) -> None:
    utf8, offsets = pack_str_ids(ids)
    assert utf8.dtype == np.uint8 and offsets.dtype == np.int64
    assert offsets.shape == (len(ids) + 1,) and offsets[0] == 0
    assert unpack_str_ids(utf8, offsets).tolist() == ids


def test_str_ids_keep_trailing_nuls_and_empty_strings() -> None:
    utf8, offsets = pack_str_ids(TRICKY_IDS)
    back = unpack_str_ids(utf8, offsets)
    assert back.dtype == object and back.tolist() == TRICKY_IDS
    assert np.array(TRICKY_IDS).tolist() != TRICKY_IDS  # what a numpy "U" array would lose


@pytest.mark.parametrize(
    ("utf8", "offsets", "match"),
    [
        (b"abc", [0, 2], "from 0 to 3"),
        (b"abc", [1, 3], "from 0 to 3"),
        (b"abc", [0, 2, 1, 3], "must not decrease"),
        (b"\xff", [0, 1], "utf-8"),
    ],
    ids=["short", "not-from-zero", "decreasing", "not-utf8"],
)
def test_bad_str_id_packing_is_refused(utf8: bytes, offsets: list[int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        unpack_str_ids(np.frombuffer(utf8, np.uint8), np.array(offsets, dtype=np.int64))


# ---------------------------------------------------------------- key bodies


@given(st.lists(int_ids, max_size=50))
def test_int_bodies_decode_like_decode_key(ids: list[int]) -> None:
    keys = encode_keys("ns", "user", "w", np.array(ids, dtype=np.int64))
    bodies = [k.rsplit(b"/", 1)[1] for k in keys]
    assert decode_int_bodies(bodies).tolist() == [decode_key(k).id for k in keys] == ids


@pytest.mark.parametrize(
    "body",
    [b"iAAAAAAAAAA=", b"iAAAAAAAAAA", b"sAAAAAAAAAAA", b"iQAAAAAAAAAA", b"i0000000000000001"],
)
def test_bad_int_bodies_are_refused(body: bytes) -> None:
    with pytest.raises(ValueError, match="int id"):
        decode_int_bodies([b"iAAAAAAAAAAB", body])


def _dump_line(key: bytes, cas: int = 1) -> bytes:
    """A metadump line as memcached writes it (URL-encodes all but A-Za-z0-9 -._~)."""
    return (
        b"key="
        + quote(key, safe="").encode()
        + b" exp=-1 la=1795393399 cas=%d " % cas
        + (b"fetch=no cls=3 size=148")
    )


def test_parse_metadump_groups_and_decodes_every_key_of_the_namespace() -> None:
    user = np.array([0, 1, -1, INT64_MIN, INT64_MAX, 7, 2**40], dtype=np.int64)
    keys = encode_keys("ns", "user", "w", user) + encode_keys("ns", "user", "s", user[:3])
    keys += encode_keys("ns", "item", "w", np.array([5, 6], dtype=np.int64))  # not in int_tables
    keys += [encode_key("ns", "word", "w", s) for s in TRICKY_IDS]
    keys += [b"ns/_meta/m/ssentinel", b"ns/_meta/m/sversion-r0", b"ns/_dense/m/scurrent"]
    foreign = [b"ns2/user/w/iAAAAAAAAAAB", b"other/user/w/iAAAAAAAAAAC", b"n"]
    lines = [_dump_line(k, i) for i, k in enumerate(foreign[:1] + keys + foreign[1:])]
    data = b"\n".join(lines) + b"\nEND\r\n"

    found = parse_metadump(data, "ns", int_tables=["user", "item_not_here"])
    bodies = found.bodies
    # the last line has no room for the vectorized window: it may come back as a body
    user_w = np.concatenate(
        [found.int_ids.get(("user", "w"), np.empty(0, np.int64))]
        + [decode_int_bodies(bodies.get(("user", "w"), []))]
    )
    assert sorted(user_w.tolist()) == sorted(user.tolist())
    # a kind that is not a row (format 1's slots, "s"): grouped by the general parser
    assert decode_int_bodies(bodies[("user", "s")]).tolist() == user[:3].tolist()
    assert decode_int_bodies(bodies[("item", "w")]).tolist() == [5, 6]
    assert decode_bodies("ns", "word", "w", bodies[("word", "w")]) == TRICKY_IDS
    assert decode_bodies("ns", "_meta", "m", bodies[("_meta", "m")]) == ["sentinel", "version-r0"]
    assert found.count == len(keys)
    assert sorted(found.keys("ns")) == sorted(keys)


def test_parse_metadump_of_an_empty_node() -> None:
    found = parse_metadump(b"END\r\n", "ns", int_tables=["user"])
    assert found.count == 0 and found.keys("ns") == []


def test_a_foreign_key_inside_the_namespace_is_an_error_naming_it() -> None:
    data = _dump_line(b"ns/user/w/iAAAAAAAAAAB") + b"\n" + _dump_line(b"ns/oops") + b"\n"
    with pytest.raises(StoreError, match=r"node n1 holds key b'ns/oops'"):
        parse_metadump(data + b"END\r\n", "ns", int_tables=["user"], node="n1")


def test_dense_file_stems_are_safe_and_unique() -> None:
    assert dense_file_stems(["dense/kernel", "bias"]) == {
        "dense/kernel": "dense__kernel",
        "bias": "bias",
    }
    stems = dense_file_stems(["dense/kernel", "dense__kernel", "Dense/Kernel", "..", "a b:c", ""])
    assert len({s.lower() for s in stems.values()}) == len(stems)
    for stem in stems.values():
        assert stem and not stem.startswith(".") and "/" not in stem and " " not in stem


# ---------------------------------------------------------------- manifests


def _tiny_checkpoint(root: Path) -> Path:
    """A valid checkpoint written with the module's own finalize step (no memcached)."""
    tmp = root / ".ck.partial"
    target = root / "ck"
    (tmp / "tables/user").mkdir(parents=True)
    (tmp / "tables/word").mkdir(parents=True)
    (tmp / "dense").mkdir()
    (tmp / "dense_slots").mkdir()
    rng = np.random.default_rng(0)
    np.save(tmp / "tables/user/ids.npy", np.array([-3, 1, 9], dtype="<i8"))
    np.save(tmp / "tables/user/rows.npy", rng.standard_normal((3, 4)).astype("<f4"))
    np.save(tmp / "tables/user/slots.npy", rng.standard_normal((3, 9)).astype("<f4"))
    np.save(tmp / "tables/user/has_slots.npy", np.array([True, False, True]))
    utf8, offsets = pack_str_ids(["", "a b", "nul\x00"])
    np.save(tmp / "tables/word/ids_utf8.npy", utf8)
    np.save(tmp / "tables/word/ids_offsets.npy", offsets)
    np.save(tmp / "tables/word/rows.npy", rng.standard_normal((3, 2)).astype("<f4"))
    np.save(tmp / "dense/dense__kernel.npy", np.ones((2, 3), dtype="<f4"))
    np.save(tmp / "dense_slots/dense__kernel.npy", np.zeros((1, 13), dtype="<f4"))
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "namespace": "ns",
        "tables": [
            {
                "name": "user",
                "dim": 4,
                "id_type": "int64",
                "optimizer": "adam",
                "slot_width": 9,
                "count": 3,
                "with_slots": 2,
                "files": {
                    "ids": "tables/user/ids.npy",
                    "rows": "tables/user/rows.npy",
                    "slots": "tables/user/slots.npy",
                    "has_slots": "tables/user/has_slots.npy",
                },
            },
            {
                "name": "word",
                "dim": 2,
                "id_type": "string",
                "optimizer": "sgd",
                "slot_width": 0,
                "count": 3,
                "with_slots": 0,
                "files": {
                    "ids_utf8": "tables/word/ids_utf8.npy",
                    "ids_offsets": "tables/word/ids_offsets.npy",
                    "rows": "tables/word/rows.npy",
                },
            },
        ],
        "dense": {
            "version": 4,
            "optimizer": "adam",
            "params": [
                {
                    "name": "dense/kernel",
                    "shape": [2, 3],
                    "file": "dense/dense__kernel.npy",
                    "slots_shape": [1, 13],
                    "slots_file": "dense_slots/dense__kernel.npy",
                }
            ],
        },
        "replica_versions": {"0": 4},
    }
    finalize(tmp, target, manifest)
    assert not tmp.exists()
    return target


def _tables(**overrides: Any) -> list[dict[str, Any]]:
    user = {"name": "user", "dim": 4, "seed": 1}
    word = {
        "name": "word",
        "dim": 2,
        "seed": 2,
        "id_type": "string",
        "optimizer": {"name": "sgd"},
    }
    user.update(overrides)
    return [user, word]


def test_a_finished_checkpoint_verifies(tmp_path: Path) -> None:
    ck = _tiny_checkpoint(tmp_path)
    manifest = verify_checkpoint(ck)
    assert set(manifest["files"]) == {p.relative_to(ck).as_posix() for p in ck.rglob("*.npy")}
    assert all(len(f["sha256"]) == 64 for f in manifest["files"].values())
    assert check_compatible(manifest, make_config(["127.0.0.1:1"], tables=_tables())) == []


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        ("flip", r"tables/user/rows\.npy: sha256 .* does not match the manifest"),
        ("delete", r"tables/user/slots\.npy: missing \(the checkpoint is partial\)"),
        ("truncate-data", r"tables/user/rows\.npy: \d+ bytes, the manifest says \d+"),
        ("truncate-manifest", r"manifest\.json: not valid JSON \(truncated or corrupt\?\)"),
        ("no-manifest", r"manifest\.json: missing: .* a save that did not finish"),
        ("version", r"format version 99; this lookup-table reads version 1"),
        ("count", r"tables/user/ids\.npy: <i8 \(3,\), the manifest promises <i8 \(4,\)"),
        ("field", r"missing or malformed field 'tables\[0\]\.dim'"),
        ("unlisted", r"tables/user/has_slots\.npy is not listed"),
    ],
)
def test_partial_or_corrupt_checkpoints_are_refused_naming_the_file(
    tmp_path: Path, damage: str, match: str
) -> None:
    ck = _tiny_checkpoint(tmp_path)
    manifest_path = ck / MANIFEST
    doc = json.loads(manifest_path.read_text())
    if damage == "flip":
        path = ck / "tables/user/rows.npy"
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x01
        path.write_bytes(bytes(data))
    elif damage == "delete":
        (ck / "tables/user/slots.npy").unlink()
    elif damage == "truncate-data":
        path = ck / "tables/user/rows.npy"
        path.write_bytes(path.read_bytes()[:-4])
    elif damage == "truncate-manifest":
        manifest_path.write_text(manifest_path.read_text()[:200])
    elif damage == "no-manifest":
        manifest_path.unlink()
    elif damage == "version":
        doc["format_version"] = 99
    elif damage == "count":
        doc["tables"][0]["count"] = 4
    elif damage == "field":
        del doc["tables"][0]["dim"]
    elif damage == "unlisted":
        del doc["files"]["tables/user/has_slots.npy"]
    if damage in ("version", "count", "field", "unlisted"):
        manifest_path.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=match):
        verify_checkpoint(ck)


def test_not_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        verify_checkpoint(tmp_path / "nope")


@pytest.mark.parametrize(
    ("tables", "match"),
    [
        (_tables(dim=8), r"table 'user': the checkpoint has dim=4 but the cluster file says dim=8"),
        (_tables(id_type="string"), r"table 'user': the checkpoint has id_type='int64'"),
        (
            _tables(optimizer={"name": "adagrad"}),
            r"table 'user': the checkpoint's slots are adam slots of 9 floats per row, but the "
            r"cluster file's optimizer 'adagrad' keeps 4",
        ),
        (_tables()[1:], r"table 'user' of the checkpoint is not in the cluster file"),
    ],
    ids=["dim", "id-type", "optimizer", "missing-table"],
)
def test_tables_that_do_not_fit_the_config_are_refused(
    tmp_path: Path, tables: list[dict[str, Any]], match: str
) -> None:
    manifest = verify_checkpoint(_tiny_checkpoint(tmp_path))
    with pytest.raises(CheckpointError, match=match):
        check_compatible(manifest, make_config(["127.0.0.1:1"], tables=tables))


def test_dense_slots_must_fit_the_default_optimizer(tmp_path: Path) -> None:
    manifest = verify_checkpoint(_tiny_checkpoint(tmp_path))
    tables = _tables(optimizer={"name": "adam"})
    config = make_config(["127.0.0.1:1"], tables=tables, optimizer={"name": "sgd"})
    with pytest.raises(CheckpointError, match=r"dense parameter 'dense/kernel'"):
        check_compatible(manifest, config)


def test_an_extra_config_table_is_a_warning(tmp_path: Path) -> None:
    manifest = verify_checkpoint(_tiny_checkpoint(tmp_path))
    tables = [*_tables(), {"name": "new", "dim": 3, "seed": 5}]
    warnings = check_compatible(manifest, make_config(["127.0.0.1:1"], tables=tables))
    assert warnings == ["table 'new' is not in the checkpoint: it starts empty"]


def test_a_moved_checkpoint_still_verifies(tmp_path: Path) -> None:
    ck = _tiny_checkpoint(tmp_path)
    copy = tmp_path / "copy"
    shutil.copytree(ck, copy)
    assert verify_checkpoint(copy)["files"] == verify_checkpoint(ck)["files"]


def test_run_blocking_returns_the_result_with_or_without_a_running_loop() -> None:
    """The sync save and restore run their coroutine with `run_blocking`: on a new loop,
    or, where one runs (Jupyter), on a private thread's loop; errors come through."""
    import asyncio
    import threading

    from lookup_table.ops.checkpoint.pipeline import run_blocking

    async def where(fail: bool = False) -> str:
        await asyncio.sleep(0)
        if fail:
            raise CheckpointError("failed inside")
        return threading.current_thread().name

    assert run_blocking(where()) == threading.current_thread().name

    async def inside() -> str:
        return run_blocking(where())

    assert asyncio.run(inside()).startswith("lookup-table-run")
    with pytest.raises(CheckpointError, match="failed inside"):
        asyncio.run(_raise_inside(run_blocking, where))


async def _raise_inside(run_blocking: Any, where: Any) -> None:
    run_blocking(where(fail=True))


@pytest.mark.parametrize("name", ["save_checkpoint", "restore_checkpoint"])
def test_the_sync_save_and_restore_take_their_async_twins_parameters(name: str) -> None:
    """`save_checkpoint` and `restore_checkpoint` are plain functions of their own name and
    docstring, with the parameters of `*_async` (keyword-only tunables included)."""
    import inspect

    from lookup_table.ops import checkpoint

    sync, coro_fn = getattr(checkpoint, name), getattr(checkpoint, name + "_async")
    assert sync.__name__ == name and not inspect.iscoroutinefunction(sync)
    assert inspect.signature(sync) == inspect.signature(coro_fn)
    params = inspect.signature(sync).parameters.values()
    assert [p.name for p in params if p.kind is p.KEYWORD_ONLY][-2:] == ["batch_ids", "progress"]
    assert f"`{name}_async` instead" in (sync.__doc__ or "")
