"""The store scrub (issue 31): every object of the store's own namespace is checked, never-read
ones included; what fails (a FIFO, a directory, a symlink, a socket, 0 bytes, a truncated or
bit-flipped object, an unparseable header, another hash's or fingerprint's object under this
name, a forged MAC, a crashed writer's temp file) is removed and unpublished, or quarantined
when it cannot be removed; a second pass finds nothing; other namespaces (another fingerprint,
another store key) and names the store does not own are never touched, and nothing is followed
or opened blocking. Real files in tmp dirs."""
from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from kvmesh.cluster.cli.store import main as store_cli
from kvmesh.kvstore.hashing import PrefixHasher, hash_hex, model_fingerprint
from kvmesh.kvstore.index.embedded import EmbeddedIndex
from kvmesh.kvstore.store.mac import StoreKey
from kvmesh.kvstore.store.objects import PREFIX_SIZE, encode_object
from kvmesh.kvstore.store.persist import PutJob, WriteBehind
from kvmesh.kvstore.store.scrub import Scrubber, ScrubSchedule
from kvmesh.kvstore.store.object_store import ObjectStore
from kvmesh.kvstore.store.store_fs import NotAFileError, open_regular
from tests.helpers import undeletable

FP = model_fingerprint({"model_type": "deepseek_v4"}, "w0", "bfloat16", 4, 1)
OTHER_FP = model_fingerprint({"model_type": "deepseek_v4"}, "w1", "bfloat16", 4, 1)
HS = PrefixHasher(FP, 4).hashes(list(range(64)))       # 16 block hashes
KEY, OTHER_KEY = StoreKey("k" * 32), StoreKey("o" * 32)
TENSORS = {"kv": torch.arange(64, dtype=torch.float32).view(8, 8)}
OLD = 1_000_000_000.0      # an mtime long past any grace period


def filled(root: Path, fingerprint: str = FP, key: StoreKey | None = None, n: int = 16, **kw) -> ObjectStore:
    store = ObjectStore(str(root), fingerprint, key=key, **kw)
    for i, h in enumerate(HS[:n]):
        store.put("block", h, HS[i - 1] if i else None, 4, TENSORS)
    store.put("checkpoint", HS[n - 1], None, 4 * n, TENSORS)
    return store


def obj(store: ObjectStore, i: int, kind: str = "block") -> Path:
    return Path(store.directory) / kind / f"{hash_hex(HS[i])}.kv"


def flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(data)


def replace(path: Path, make) -> None:
    path.unlink()
    make(path)


def unix_socket(path: Path) -> None:
    """A socket file at `path` (bound by a relative name: tmp paths outgrow AF_UNIX's 108 bytes)."""
    cwd = os.getcwd()
    s = socket.socket(socket.AF_UNIX)
    try:
        os.chdir(path.parent)
        s.bind(path.name)
    finally:
        os.chdir(cwd)
        s.close()


def tmp_name(i: int) -> str:
    return f".{hash_hex(HS[i])}.kv.{'a' * 32}.tmp"


def snapshot(root: Path) -> dict[str, tuple]:
    """Every name under `root` (links not followed) -> (type, size, content digest)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            st = p.lstat()
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() and not p.is_symlink() else None
            out[str(p.relative_to(root))] = (st.st_mode >> 12, st.st_size, digest)
    return out


@pytest.fixture
def damaged(tmp_path):
    """An own namespace with one of each fault, a second fingerprint's namespace and a store-key
    namespace of the same fingerprint (valid and corrupt objects each), and names the store does
    not own. Returns (store, {reason: count expected}, the other namespaces' snapshot)."""
    root = tmp_path / "store"
    other, keyed = filled(root, OTHER_FP), filled(root, key=KEY)
    flip(obj(other, 1), -1)
    obj(other, 2).write_bytes(b"")
    replace(obj(keyed, 3), os.mkfifo)
    store = filled(root)
    replace(obj(store, 0), os.mkfifo)
    replace(obj(store, 1), os.mkdir)
    (obj(store, 1) / "inside").write_bytes(b"x")
    replace(obj(store, 2), lambda p: p.symlink_to(obj(store, 9)))      # a valid object, if followed
    replace(obj(store, 3), lambda p: p.symlink_to(tmp_path / "nowhere"))
    replace(obj(store, 4), unix_socket)
    obj(store, 5).write_bytes(b"")
    obj(store, 6).write_bytes(obj(store, 6).read_bytes()[:-7])          # truncated: wrong size
    flip(obj(store, 7), -1)                                              # a flipped data bit
    flip(obj(store, 8), PREFIX_SIZE + 2)                                 # an unparseable header
    obj(store, 10).write_bytes(obj(store, 10).read_bytes() + b"\0")     # trailing bytes
    obj(store, 13).write_bytes(obj(store, 12).read_bytes())             # another hash's object, renamed
    obj(store, 14).write_bytes(obj(other, 14).read_bytes())             # another fingerprint's, copied in
    flip(obj(store, 15, "checkpoint"), -1)
    blocks = Path(store.directory) / "block"
    for name, age in ((tmp_name(11), OLD), (tmp_name(12), None)):       # a crashed write, a live one
        (blocks / name).write_bytes(b"partial")
        os.utime(blocks / name, (age, age)) if age else None
    (blocks / "README").write_bytes(b"not the store's")
    (blocks / "0123").mkdir()
    (tmp_path / "store" / "stray.txt").write_bytes(b"x")
    expect = {"not_regular": 5, "empty": 1, "corrupt": 7, "stale_tmp": 1}
    others = {k: v for k, v in snapshot(root).items() if not k.startswith(store.namespace + "/")}
    return store, expect, others


def test_a_scrub_removes_what_fails_and_leaves_everything_else_alone(damaged, tmp_path):
    store, expect, others = damaged
    index = EmbeddedIndex(FP, namespace=store.namespace)
    index.publish_blocks(HS)
    store.attach_index(index)
    report = Scrubber(store).run()
    assert report.found == expect and report.complete
    assert report.removed == sum(expect.values()) and report.quarantined == 0
    assert report.ok == 4                    # 16 blocks and a checkpoint, 13 of them damaged
    blocks = Path(store.directory) / "block"
    assert sorted(p.name for p in blocks.iterdir()) == sorted(
        ["README", "0123", tmp_name(12)] + [f"{hash_hex(HS[i])}.kv" for i in (9, 11, 12, 15)])
    assert obj(store, 9).read_bytes()                               # the symlink's target is intact
    others_now = {k: v for k, v in snapshot(tmp_path / "store").items() if not k.startswith(store.namespace + "/")}
    assert others_now == others                                     # other namespaces, foreign files: untouched
    assert index.lookup(HS)[0] == 0                                 # removed objects are unpublished
    again = Scrubber(store).run()
    assert again.clean and again.removed == 0 and again.ok == report.ok
    stats = store.stats()
    assert (stats.scrub_removed, stats.scrub_passes, stats.scrub_ok) == (report.removed, 2, 2 * report.ok)


def test_a_dry_run_reports_the_same_and_changes_nothing(damaged, tmp_path):
    store, expect, _ = damaged
    before = snapshot(tmp_path / "store")
    report = Scrubber(store).run(dry_run=True)
    assert report.found == expect and report.removed == report.quarantined == 0
    assert snapshot(tmp_path / "store") == before
    assert store.stats().scrub_passes == 0


def test_a_namespace_is_scrubbed_against_its_own_key_only(tmp_path):
    keyed = filled(tmp_path, key=KEY)
    forged = filled(tmp_path / "b", key=OTHER_KEY)
    obj(keyed, 1).write_bytes(encode_object(FP, "block", HS[1], HS[0], 4, TENSORS))              # no MAC
    obj(keyed, 2).write_bytes(obj(forged, 2).read_bytes())                                       # another key's MAC
    flip(obj(keyed, 3), -40)                                                                     # a flipped data bit
    unkeyed = filled(tmp_path)
    flip(obj(unkeyed, 4), -1)
    before = snapshot(Path(keyed.directory))
    assert Scrubber(unkeyed).run().found == {"corrupt": 1}
    assert snapshot(Path(keyed.directory)) == before               # the keyed namespace is another's
    without_key = ObjectStore(str(tmp_path), FP, namespace=keyed.namespace)
    assert Scrubber(without_key).run(dry_run=True).found == {"corrupt": 1}     # checksums only
    assert Scrubber(keyed).run().found == {"unauthenticated": 2, "corrupt": 1}
    assert not obj(keyed, 1).exists() and not obj(keyed, 2).exists() and obj(keyed, 4).exists()


def test_an_undeletable_bad_object_is_quarantined_and_not_counted_again(tmp_path):
    store = filled(tmp_path)
    flip(obj(store, 0), -1)
    with undeletable(obj(store, 0)):
        report = Scrubber(store).run()
        assert (report.quarantined, report.removed) == (1, 0)
        assert store.is_quarantined("block", HS[0])
        again = Scrubber(store).run()
        assert again.clean and again.untouched == 1


def test_a_budgeted_pass_resumes_where_the_last_stopped(tmp_path):
    store = filled(tmp_path)
    for i in (1, 14):
        flip(obj(store, i), -1)
    size = obj(store, 0).stat().st_size
    scrubber = Scrubber(store)
    reports = [scrubber.run(max_bytes=5 * size) for _ in range(4)]
    assert [r.complete for r in reports] == [False, False, False, True]
    assert [r.checked for r in reports] == [5, 5, 5, 2]
    assert sum(r.ok for r in reports) == 15 and sum(r.removed for r in reports) == 2
    assert scrubber.run().clean


def test_a_set_stop_event_ends_a_pass_at_once(tmp_path):
    stop = threading.Event()
    stop.set()
    report = Scrubber(filled(tmp_path)).run(stop=stop)
    assert report.checked == 0 and not report.complete


def test_the_write_behind_thread_runs_the_background_scrub_between_puts(tmp_path):
    store = filled(tmp_path, n=4)
    replace(obj(store, 1), os.mkfifo)
    writer = WriteBehind(store, scrub=ScrubSchedule(Scrubber(store), interval_s=0.05, pass_bytes=1 << 20))
    try:
        writer.submit(PutJob("block", HS[5], None, 4, TENSORS))
        deadline = time.monotonic() + 10
        while store.stats().scrub_passes < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert writer.flush(5) and writer.stats["written"] == 1
    finally:
        writer.close()
    stats = store.stats()
    assert stats.scrub_passes >= 2 and stats.scrub_removed == 1 and not obj(store, 1).exists()
    assert obj(store, 5).exists()


def test_a_scrub_interval_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="interval_s"):
        ScrubSchedule(Scrubber(filled(tmp_path, n=1)), 0, None)


def test_reads_refuse_a_symlink_at_an_objects_path(tmp_path):
    store = filled(tmp_path, n=2)
    replace(obj(store, 0), lambda p: p.symlink_to(obj(store, 1)))
    with pytest.raises(OSError):
        open_regular(str(obj(store, 0)))
    assert store.get("block", HS[0]) is None and not obj(store, 0).is_symlink()
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(NotAFileError):
        open_regular(str(tmp_path / "fifo"))


def test_the_cli_scrubs_one_namespace_and_prints_json(tmp_path, capsys):
    store, other = filled(tmp_path), filled(tmp_path, OTHER_FP)
    obj(store, 0).write_bytes(b"")
    flip(obj(other, 0), -1)
    args = ["store", "scrub", "--store", str(tmp_path), "--namespace", store.namespace, "--json"]
    assert store_cli(args + ["--dry-run"]) == 0
    dry = json.loads(capsys.readouterr().out)
    assert dry["found"] == {"empty": 1} and dry["dry_run"] and obj(store, 0).exists()
    assert store_cli(args) == 0
    done = json.loads(capsys.readouterr().out)
    assert done["removed"] == 1 and not obj(store, 0).exists() and obj(other, 0).stat().st_size > 0
    assert store_cli(["store", "scrub", "--store", str(tmp_path)]) == 0      # every namespace, a table
    table = capsys.readouterr().out
    assert "namespace" in table.splitlines()[0] and "found: corrupt 1" in table
    assert not obj(other, 0).exists()


def test_the_cli_verifies_macs_with_the_namespaces_own_key_only(tmp_path, capsys, monkeypatch):
    keyed = filled(tmp_path, key=KEY)
    obj(keyed, 0).write_bytes(encode_object(FP, "block", HS[0], None, 4, TENSORS))    # no MAC
    args = ["store", "scrub", "--store", str(tmp_path), "--json", "--dry-run"]
    monkeypatch.setenv("KVMESH_STORE_KEY", "o" * 32)           # another key: checksums only
    assert store_cli(args) == 0
    assert json.loads(capsys.readouterr().out)["clean"]
    monkeypatch.setenv("KVMESH_STORE_KEY", "k" * 32)
    assert store_cli(args) == 0
    assert json.loads(capsys.readouterr().out)["found"] == {"unauthenticated": 1}
