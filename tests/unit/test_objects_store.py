"""Store objects and the object store (DESIGN §4, invariant 5): what is read back is
exactly what was written, or it is a counted, unpublished miss; an object MAC'd under one key
(kvstore/store/mac.py) is refused under another and without a MAC."""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvmesh.cluster.cli.store import add_parser, run_store
from kvmesh.kvstore.hashing import PrefixHasher, hash_hex, model_fingerprint, store_namespace
from kvmesh.kvstore.store.mac import StoreKey
from kvmesh.kvstore.index.embedded import EmbeddedIndex, make_index
from kvmesh.kvstore.index.kv_events import KvEventIndex, KvEventPublisher, LocalEventBus
from kvmesh.kvstore.store.objects import (
    CHECKSUM_OFFSET,
    DATA_ALIGN,
    MAGIC,
    PREFIX_SIZE,
    CorruptObjectError,
    UnauthenticatedObjectError,
    decode_object,
    encode_object,
)
from kvmesh.kvstore.store.object_store import ObjectStore, list_namespaces
from kvmesh.kvstore.store.read_buffers import ReadBuffers

REPO = Path(__file__).resolve().parents[2]
FP = model_fingerprint({"model_type": "deepseek_v4"}, "w0", "bfloat16", 4, 1)
OTHER_FP = model_fingerprint({"model_type": "deepseek_v4"}, "w1", "bfloat16", 4, 1)
HS = PrefixHasher(FP, 4).hashes(list(range(64)))


def _tensors(seed: int = 0, n: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "csa_kv": torch.randn(2, n, generator=g),
        "swa_kv": torch.randn(3, n, generator=g).to(torch.bfloat16),
        "positions": torch.arange(n, dtype=torch.int64),
        "flags": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 8, dtype=torch.float16),
    }


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name


def _store(tmp_path: Path, capacity: int | None = None) -> tuple[ObjectStore, EmbeddedIndex]:
    index = EmbeddedIndex(FP)
    return ObjectStore(str(tmp_path / "store"), FP, capacity, index), index


# -- object format -----------------------------------------------------------------


def test_roundtrip_preserves_fp32_bf16_int_bool_and_empty_tensors() -> None:
    tensors = _tensors()
    obj = decode_object(encode_object(FP, "block", HS[1], HS[0], 4, tensors), FP, HS[1], "block")
    _assert_same(tensors, obj.tensors)
    assert (obj.fingerprint, obj.kind, obj.hash, obj.parent, obj.token_count) == (FP, "block", HS[1], HS[0], 4)


def test_decode_of_a_writable_buffer_is_zero_copy() -> None:
    buf = bytearray(encode_object(FP, "checkpoint", HS[0], None, 4, _tensors()))
    obj = decode_object(buf, FP, HS[0])
    start = torch.frombuffer(buf, dtype=torch.uint8).data_ptr()
    offset = obj.tensors["swa_kv"].data_ptr() - start
    assert 0 < offset < len(buf) and offset % DATA_ALIGN == 0


def test_layout_starts_with_the_documented_prefix() -> None:
    buf = encode_object(FP, "block", HS[0], None, 4, _tensors())
    assert buf[:8] == MAGIC and int.from_bytes(buf[8:12], "little") == 1
    assert PREFIX_SIZE == 24 and CHECKSUM_OFFSET == 16


@pytest.mark.parametrize("cut", [0, 7, PREFIX_SIZE, PREFIX_SIZE + 10, -1])
def test_truncated_object_is_rejected(cut: int) -> None:
    buf = encode_object(FP, "block", HS[0], None, 4, _tensors())
    with pytest.raises(CorruptObjectError, match="truncated"):
        decode_object(buf[:cut], FP, HS[0])


@pytest.mark.parametrize(
    "position, message",
    [(0, "magic"), (9, "version"), (CHECKSUM_OFFSET + 1, "checksum"), (PREFIX_SIZE + 40, None), (-1, "checksum")],
)
def test_flipped_bit_anywhere_is_rejected(position: int, message: str | None) -> None:
    buf = bytearray(encode_object(FP, "block", HS[0], None, 4, _tensors()))
    buf[position] ^= 0x10
    with pytest.raises(CorruptObjectError, match=message):
        decode_object(buf, FP, HS[0])


def test_foreign_fingerprint_wrong_hash_and_wrong_kind_are_rejected() -> None:
    buf = encode_object(FP, "block", HS[0], None, 4, _tensors())
    with pytest.raises(CorruptObjectError, match="foreign fingerprint"):
        decode_object(buf, OTHER_FP, HS[0])
    with pytest.raises(CorruptObjectError, match=f"expected {hash_hex(HS[1])}"):
        decode_object(buf, FP, HS[1])
    with pytest.raises(CorruptObjectError, match="kind"):
        decode_object(buf, FP, HS[0], "checkpoint")


def test_unsupported_dtype_is_refused_at_encode() -> None:
    with pytest.raises(TypeError, match="complex64"):
        encode_object(FP, "block", HS[0], None, 4, {"x": torch.zeros(2, dtype=torch.complex64)})


# -- object store ------------------------------------------------------------------


def test_store_roundtrip_publishes_and_reads_back(tmp_path: Path) -> None:
    store, index = _store(tmp_path)
    tensors = _tensors()
    written = store.put("block", HS[0], None, 4, tensors)
    store.put("checkpoint", HS[0], None, 4, _tensors(1))
    _assert_same(tensors, store.get("block", HS[0]).tensors)
    _assert_same(_tensors(1), store.get("checkpoint", HS[0]).tensors)
    assert index.lookup(HS[:2]) == (1, (0,), {})
    stats = store.stats()
    assert (stats.writes, stats.reads, stats.objects) == (2, 2, {"block": 1, "checkpoint": 1})
    assert stats.bytes_written == stats.total_bytes == written + stats.bytes["checkpoint"]
    assert store.get("block", HS[5]) is None and store.stats().misses == 1
    assert store.contains("block", HS[0]) and not store.contains("checkpoint", HS[5])


def test_tensors_read_from_the_store_can_be_written_without_touching_the_file(tmp_path: Path) -> None:
    store, _ = _store(tmp_path)
    store.put("block", HS[0], None, 4, _tensors())
    store.get("block", HS[0]).tensors["csa_kv"].zero_()  # copy-on-write mapping
    _assert_same(_tensors(), store.get("block", HS[0]).tensors)


def _object_path(tmp_path: Path, kind: str, h: int) -> Path:
    return tmp_path / "store" / FP[:16] / kind / f"{hash_hex(h)}.kv"


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-5])


def _flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


def _foreign(path: Path) -> None:
    path.write_bytes(encode_object(OTHER_FP, "block", HS[0], None, 4, _tensors()))


def _wrong_hash(path: Path) -> None:
    path.write_bytes(encode_object(FP, "block", HS[3], None, 4, _tensors()))


@pytest.mark.parametrize("damage", [_truncate, _flip_bit, _foreign, _wrong_hash, lambda p: p.write_bytes(b"")])
def test_damaged_object_is_a_counted_miss_removed_from_store_and_index(tmp_path: Path, damage) -> None:
    store, index = _store(tmp_path)
    store.put("block", HS[0], None, 4, _tensors())
    damage(_object_path(tmp_path, "block", HS[0]))
    assert store.get("block", HS[0]) is None
    assert store.stats().corrupt == 1
    assert not _object_path(tmp_path, "block", HS[0]).exists()
    assert index.lookup(HS[:1]).stored == 0


def test_capacity_gc_evicts_the_least_recently_read_and_unpublishes(tmp_path: Path) -> None:
    sizes = [len(encode_object(FP, "block", HS[i], HS[i - 1] if i else None, 4, _tensors())) for i in range(4)]
    store, index = _store(tmp_path, capacity=sum(sizes[:3]))
    for i in range(3):
        store.put("block", HS[i], HS[i - 1] if i else None, 4, _tensors())
    store.get("block", HS[0])  # block 1 is now the least recently used
    store.put("block", HS[3], HS[2], 4, _tensors())
    assert sorted(store.list("block")) == sorted([HS[0], HS[2], HS[3]])
    assert index.lookup(HS[:4]).stored == 1  # block 1 unpublished: the walk stops there
    assert store.stats().evicted == 1 and store.stats().total_bytes == sizes[0] + sizes[2] + sizes[3]
    assert store.gc(target_bytes=sizes[3]) == 2
    assert store.list("block") == [HS[3]]


def test_puts_and_evictions_are_pushed_as_store_tier_events_of_this_process(tmp_path: Path) -> None:
    size = len(encode_object(FP, "block", HS[0], None, 4, _tensors()))
    store, _ = _store(tmp_path, capacity=2 * size)
    bus = LocalEventBus()
    router = KvEventIndex(bus.request_snapshot)
    store.attach_events(KvEventPublisher("w/dp0", bus))
    for i in range(4):
        store.put("block", HS[i], HS[i - 1] if i else None, 4, _tensors())
    store.delete("block", HS[2])                            # blocks 0 and 1 were evicted by the puts
    store.delete("block", HS[5])                            # never put here: nothing to say
    for e in bus.read():
        router.apply(e)
    assert router.holdings("w/dp0")["store"] == set(store.list("block")) == {HS[3]}
    assert router.longest_prefix(HS[3:4]) == {} and router.longest_prefix(HS[3:4], tiers=("store",)) == {"w/dp0": 1}


def test_lru_order_survives_reopen_via_file_mtimes(tmp_path: Path) -> None:
    store, _ = _store(tmp_path)
    for i in range(3):
        store.put("block", HS[i], None, 4, _tensors())
        path = _object_path(tmp_path, "block", HS[i])
        os.utime(path, (1000 + i, 1000 + i))
    os.utime(_object_path(tmp_path, "block", HS[0]), (2000, 2000))  # newest
    size = store.stats().total_bytes // 3
    reopened = ObjectStore(str(tmp_path / "store"), FP, capacity_bytes=2 * size)
    assert reopened.gc() == 1
    assert sorted(reopened.list("block")) == sorted([HS[0], HS[2]])


def test_object_larger_than_capacity_is_skipped_not_failed(tmp_path: Path) -> None:
    store, index = _store(tmp_path, capacity=100)
    assert store.put("block", HS[0], None, 4, _tensors()) == 0
    assert store.list("block") == [] and store.stats().skipped == 1
    assert index.lookup(HS[:1]).stored == 0


def test_atomic_put_leaves_no_temp_files(tmp_path: Path) -> None:
    store, _ = _store(tmp_path)
    for i in range(4):
        store.put("block", HS[i], None, 4, _tensors(i))
    store.put("block", HS[0], None, 4, _tensors(9))  # replace an existing object
    names = sorted(p.name for p in (tmp_path / "store" / FP[:16] / "block").iterdir())
    assert names == sorted(f"{hash_hex(h)}.kv" for h in HS[:4])
    _assert_same(_tensors(9), store.get("block", HS[0]).tensors)


def test_embedded_index_rebuild_from_store_matches_the_store(tmp_path: Path) -> None:
    store, _ = _store(tmp_path)
    for i in range(3):
        store.put("block", HS[i], None, 4, _tensors())
    store.put("checkpoint", HS[2], None, 4, _tensors())
    stale = EmbeddedIndex(FP)
    stale.publish_blocks(HS[:6])  # says more than the store has
    assert stale.rebuild_from(store) == 4
    assert stale.lookup(HS[:6]) == (3, (2,), {})
    assert make_index("local", FP, store).lookup(HS[:6]) == (3, (2,), {})
    with pytest.raises(ValueError, match="fingerprint"):
        EmbeddedIndex(OTHER_FP).rebuild_from(store)


def test_store_namespaces_are_claimed_by_one_fingerprint(tmp_path: Path) -> None:
    store, _ = _store(tmp_path)
    ObjectStore(str(tmp_path / "store"), OTHER_FP).put("block", HS[0], None, 4, _tensors())
    assert list_namespaces(str(tmp_path / "store")) == {FP[:16]: FP, OTHER_FP[:16]: OTHER_FP}
    assert store.list("block") == []  # the other model's object is not ours
    collision = FP[:16] + "0" * 16
    with pytest.raises(ValueError, match="belongs to fingerprint"):
        ObjectStore(str(tmp_path / "store"), collision)


def test_a_wrong_store_key_never_removes_or_overwrites_another_keys_objects(tmp_path: Path) -> None:
    """The issue-23 scenario at the store: key one writes, key two (and an unkeyed node) run
    on the same root, miss and write; key one's objects are still there and verify."""
    root = str(tmp_path / "store")
    one, two = StoreKey("1" * 32), StoreKey("2" * 32)
    first = ObjectStore(root, FP, key=one)
    first.put("block", HS[0], None, 4, _tensors(1))
    for key in (two, None):
        node = ObjectStore(root, FP, key=key)
        assert node.get("block", HS[0]) is None and node.stats().corrupt == 0   # a plain miss
        node.put("block", HS[0], None, 4, _tensors(2))      # recomputed: written in its own namespace
    again = ObjectStore(root, FP, key=one)
    _assert_same(again.get("block", HS[0]).tensors, _tensors(1))
    assert again.stats().corrupt == 0
    spaces = list_namespaces(root)
    assert set(spaces) == {FP[:16], f"{FP[:16]}-k{one.key_id}", f"{FP[:16]}-k{two.key_id}"}
    assert set(spaces.values()) == {FP}


def test_the_key_id_names_a_key_without_revealing_it() -> None:
    one = StoreKey("1" * 32)
    assert one.key_id == StoreKey("1" * 32).key_id != StoreKey("1" * 31 + "2").key_id
    assert len(one.key_id) == 16 and "1" * 16 not in one.key_id
    assert store_namespace(FP, one.key_id) == f"{FP[:16]}-k{one.key_id}" and store_namespace(FP) == FP[:16]
    with pytest.raises(ValueError, match="key_id"):
        store_namespace(FP, "not-hex")


def test_an_index_serves_only_its_stores_namespace(tmp_path: Path) -> None:
    keyed = ObjectStore(str(tmp_path / "store"), FP, key=StoreKey("1" * 32))
    assert make_index("local", FP, keyed).namespace == keyed.namespace
    with pytest.raises(ValueError, match="namespace"):
        keyed.attach_index(EmbeddedIndex(FP))       # the unkeyed namespace's index
    with pytest.raises(ValueError, match="namespace"):
        EmbeddedIndex(FP).rebuild_from(keyed)
    with pytest.raises(ValueError, match="not one of fingerprint"):
        EmbeddedIndex(FP, namespace=f"{OTHER_FP[:16]}-k{'0' * 16}")


def test_store_cli_removes_an_old_keys_namespace_and_nothing_else(tmp_path: Path) -> None:
    root = str(tmp_path / "store")
    old, new = ObjectStore(root, FP, key=StoreKey("o" * 32)), ObjectStore(root, FP, key=StoreKey("n" * 32))
    for store in (old, new):
        store.put("block", HS[0], None, 4, _tensors())
    code, out = _cli("store", "stats", "--store", root)
    assert code == 0 and old.namespace in out and new.namespace in out
    code, out = _cli("store", "gc", "--store", root, "--namespace", old.namespace, "--all")
    assert code == 0 and f"{old.namespace}: evicted 1 objects" in out and new.namespace not in out
    assert old.list("block") == [] and new.get("block", HS[0]) is not None
    assert _cli("store", "gc", "--store", root, "--namespace", "0" * 16, "--all")[0] == 2


def test_file_uri_is_the_same_store(tmp_path: Path) -> None:
    store, _ = _store(tmp_path)
    store.put("block", HS[0], None, 4, _tensors())
    via_uri = ObjectStore(f"file://{tmp_path / 'store'}", FP)
    _assert_same(_tensors(), via_uri.get("block", HS[0]).tensors)


def test_non_local_filesystem_streams_writes_and_verifies_reads() -> None:
    index = EmbeddedIndex(FP)
    store = ObjectStore("mock:///bucket/kv", FP, None, index)  # pyarrow's in-memory filesystem
    store.put("block", HS[0], None, 4, _tensors())
    _assert_same(_tensors(), store.get("block", HS[0]).tensors)
    with store._fs.open_output_stream(f"bucket/kv/{FP[:16]}/block/{hash_hex(HS[1])}.kv") as out:
        out.write(encode_object(FP, "block", HS[1], HS[0], 4, _tensors())[:-1])
    index.publish_blocks([HS[1]])
    assert store.get("block", HS[1]) is None and store.stats().corrupt == 1
    assert store.list("block") == [HS[0]] and index.lookup(HS[:2]).stored == 1


# -- store CLI ---------------------------------------------------------------------


def _cli(*argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    out = io.StringIO()
    return run_store(parser.parse_args(list(argv)), out), out.getvalue()


def test_store_cli_stats_ls_and_gc(tmp_path: Path) -> None:
    store, _ = _store(tmp_path)
    for i in range(3):
        size = store.put("block", HS[i], None, 4, _tensors())
    root = str(tmp_path / "store")
    code, out = _cli("store", "stats", "--store", root)
    assert code == 0 and FP[:16] in out and str(3 * size) in out
    code, out = _cli("store", "ls", "--store", root, "--fingerprint", FP)
    assert code == 0 and all(f"block/{hash_hex(h)}" in out for h in HS[:3])
    assert _cli("store", "gc", "--store", root)[0] == 2  # gc needs --capacity
    code, out = _cli("store", "gc", "--store", root, "--capacity", str(size))
    assert code == 0 and "evicted 2 objects" in out
    assert len(ObjectStore(root, FP).list("block")) == 1


NO_KEY_WARNING = "anyone who can write to it controls outputs"


@pytest.mark.parametrize("written_with_key", [False, True], ids=["unkeyed_store", "keyed_store"])
def test_store_cli_stats_warns_that_the_store_has_no_key_only_when_it_has_none(
        tmp_path, monkeypatch, caplog, written_with_key) -> None:
    """`kvmesh store stats` reads the key as serving does ($KVMESH_STORE_KEY). Serving's warning
    ("store ... has no key ... anyone who can write to it controls outputs") is given only when it
    is true: no key set and a namespace written without one. With the key set, no command gives it
    (issue 48 item 6: it did, with the key set)."""
    import logging
    from kvmesh.kvstore.store import object_store
    secret = "k" * 32
    root = str(tmp_path / "store")
    ObjectStore(root, FP, key=StoreKey(secret) if written_with_key else None).put("block", HS[0], None, 4, _tensors())

    def warned(*argv: str) -> bool:
        caplog.clear()
        monkeypatch.setattr(object_store, "_trust_warned", False)
        with caplog.at_level(logging.WARNING, logger=object_store.log.name):
            code, out = _cli("store", *argv, "--store", root)
        assert code == 0 and ("block" in out or argv[0] != "stats"), out
        return any(NO_KEY_WARNING in r.getMessage() for r in caplog.records)

    monkeypatch.setenv("KVMESH_STORE_KEY", secret)
    assert not warned("stats"), caplog.text
    assert not any(warned(*argv) for argv in (("ls",), ("scrub",), ("gc", "--capacity", "1")))
    monkeypatch.delenv("KVMESH_STORE_KEY")
    assert warned("stats") is not written_with_key, caplog.text      # only an unkeyed store has no key
    monkeypatch.setenv("KVMESH_STORE_KEY", "")                        # empty is unset, as for serving
    assert warned("stats") is not written_with_key, caplog.text


def test_store_cli_names_the_variable_of_a_store_key_too_short(tmp_path, monkeypatch, capsys) -> None:
    ObjectStore(str(tmp_path / "store"), FP)
    monkeypatch.setenv("KVMESH_STORE_KEY", "short")
    assert _cli("store", "stats", "--store", str(tmp_path / "store"))[0] == 2
    assert "KVMESH_STORE_KEY: the store key must be at least 16 bytes" in capsys.readouterr().err


def test_a_serving_store_warns_that_it_has_no_key_only_without_one(tmp_path, monkeypatch, caplog) -> None:
    import logging
    from kvmesh.kvstore.store import object_store
    monkeypatch.setattr(object_store, "_trust_warned", False)
    with caplog.at_level(logging.WARNING, logger=object_store.log.name):
        ObjectStore(str(tmp_path / "keyed"), FP, key=StoreKey("k" * 32))
        assert NO_KEY_WARNING not in caplog.text
        ObjectStore(str(tmp_path / "unkeyed"), FP)
    assert NO_KEY_WARNING in caplog.text


@pytest.mark.slow     # a CLI subprocess
def test_store_cli_runs_as_a_module(tmp_path: Path) -> None:
    store, _ = _store(tmp_path)
    store.put("checkpoint", HS[0], None, 4, _tensors())
    result = subprocess.run(
        [sys.executable, "-m", "kvmesh.cluster.cli.store", "store", "stats", "--store", str(tmp_path / "store")],
        cwd=REPO, capture_output=True, text=True, check=True,
    )
    assert "checkpoint" in result.stdout and FP[:16] in result.stdout


def test_an_object_macd_with_one_key_is_rejected_under_another_and_without_a_mac():
    t = {"x": torch.arange(8, dtype=torch.float32)}
    a, b = StoreKey("k" * 16), StoreKey("j" * 16)
    good = encode_object(FP, "block", 7, None, 16, t, a)
    assert torch.equal(decode_object(bytearray(good), FP, 7, "block", key=a).tensors["x"], t["x"])
    assert torch.equal(decode_object(bytearray(good), FP, 7, "block").tensors["x"], t["x"])  # keyless: trusts
    with pytest.raises(UnauthenticatedObjectError):
        decode_object(bytearray(good), FP, 7, "block", key=b)
    with pytest.raises(UnauthenticatedObjectError):
        decode_object(bytearray(encode_object(FP, "block", 7, None, 16, t)), FP, 7, "block", key=a)
    assert "k" * 16 not in repr(a) and len(pytest.importorskip("kvmesh.kvstore.store.mac").StoreKey("z" * 16).mac([b""])) == 32
    with pytest.raises(ValueError):
        StoreKey("short")


def test_nixl_reads_give_the_same_objects_as_the_plain_reads_and_a_bad_one_is_still_a_miss(tmp_path: Path) -> None:
    """Issue 45 item 4: block objects READ by NIXL's POSIX backend (in chunks, into registered
    memory) decode to the same tensors as this process's reads; one object with a flipped byte
    is the same counted miss either way, and an object of another size is read plainly."""
    from kvmesh.kvstore.store import nixl_reader
    writer = ObjectStore(str(tmp_path), FP)
    hashes = list(range(1, 2 * nixl_reader.CHUNK_OBJECTS + 4))       # three chunks, the last a short one
    g = torch.Generator().manual_seed(3)
    for h in hashes:
        writer.put("block", h, None, 4, {"k": torch.randn(4, 64, generator=g), "v": torch.randn(4, 32, generator=g)})
    path = Path(writer._path("block", hashes[5]))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(data)
    got = {}
    for reader in ("nixl", "file"):
        store = ObjectStore(str(tmp_path), FP, reader=reader, staging_bytes=1 << 20)
        assert store.reader == reader
        store._staging.fill_(0xAB)          # stale bytes a read that did not happen would leave
        out = store.get_many("block", hashes)
        got[reader] = [None if o is None else {k: o[k].clone() for k in o} for o in out]
        assert out[5] is None and store.stats().corrupt == 1 and not path.exists()
        writer.put("block", hashes[5], None, 4, {"k": torch.zeros(4, 64), "v": torch.zeros(4, 32)})
        path.write_bytes(data)          # corrupt again for the next reader
    assert all((a is None) == (b is None) and (a is None or all(torch.equal(a[k], b[k]) for k in a))
               for a, b in zip(got["nixl"], got["file"]))
    assert sum(o is not None for o in got["nixl"]) == len(hashes) - 1


def test_the_nixl_reader_unavailable_fails_at_start_when_asked_for_and_auto_reads_plainly(tmp_path, monkeypatch):
    from kvmesh.kvstore.store import nixl_reader
    from kvmesh.kvstore.store.object_store import StoreUnavailableError
    from kvmesh.kvstore.transfer.nixl_transfer import NixlUnavailable

    def missing():
        raise NixlUnavailable("nixl cannot be imported: no module")
    monkeypatch.setattr(nixl_reader, "shared_reader", missing)
    with pytest.raises(StoreUnavailableError, match="nixl reader is unavailable: nixl cannot be imported"):
        ObjectStore(str(tmp_path), FP, reader="nixl")
    assert ObjectStore(str(tmp_path), FP, reader="auto").reader == "file"
    with pytest.raises(ValueError, match="reader must be one of"):
        ObjectStore(str(tmp_path), FP, reader="fast")


def test_a_tensor_name_that_looks_like_the_table_key_still_decodes_to_its_own_table() -> None:
    """The table cache is keyed by the header's table text (objects.py `_table_text`): a name
    holding `"tensors":[` and `]` is escaped in the header and cannot move where it is read."""
    tensors = {'a"tensors":[1]': torch.arange(6, dtype=torch.int32).view(2, 3), "b]": torch.ones(4)}
    for _ in range(2):      # the second decode takes the cached text
        obj = decode_object(bytearray(encode_object(FP, "block", 9, None, 1, tensors)), FP, 9, "block")
        assert set(obj.tensors) == set(tensors)
        assert all(torch.equal(obj.tensors[k], v) for k, v in tensors.items())


def test_a_prefetch_read_reuses_its_buffer_once_no_object_views_it_and_never_before(tmp_path: Path) -> None:
    """get_many(own=True)'s rows come from kept buffers (no fresh memory faulted in per restore);
    a buffer goes back only when every object read into it is gone, and at most
    read_buffer_bytes of them are kept."""
    store = ObjectStore(str(tmp_path / "store"), FP, read_buffer_bytes=4 << 20)
    for i, h in enumerate(HS[:8]):
        store.put("block", h, None, 4, _tensors(i))
    first = store.get_many("block", HS[:8], own=True)
    held = first[3]                          # one object of the read still in use
    base = held.rows.data_ptr()
    del first
    second = store.get_many("block", HS[:8], own=True)
    assert second[0].rows.data_ptr() != base        # still viewed: not handed out again
    _assert_same(_tensors(3), dict(held.items()))   # and its bytes untouched by the second read
    del held
    third = store.get_many("block", HS[:8], own=True)
    assert third[0].rows.data_ptr() == base         # free again: reused
    for i, obj in enumerate(third):
        _assert_same(_tensors(i), dict(obj.items()))

    buffers = ReadBuffers(keep_bytes=64 << 10)      # keeps one 64 KiB buffer, not two
    a, b = buffers.take(1000), buffers.take(1000)
    del a, b
    assert buffers.free_bytes == 64 << 10
    assert ReadBuffers(0).take(10).numel() == 10
