"""kvmesh.kvstore.store.quarantine on a real folder: what is persisted (undeletable objects) and what is this
process's only (hung reads), lifting, and a damaged or unreadable list costing only a re-read."""
import logging

import pyarrow.fs as pafs

from kvmesh.kvstore.hashing import hash_hex
from kvmesh.kvstore.log_once import LogOnce
from kvmesh.kvstore.store.quarantine import QUARANTINE_FILE, Quarantine


def quarantine(path) -> Quarantine:
    return Quarantine(pafs.LocalFileSystem(), str(path), LogOnce(logging.getLogger("kvmesh.kvstore.store.object_store")))


def test_only_undeletable_objects_are_persisted_and_lifting_rewrites_the_list(tmp_path):
    q = quarantine(tmp_path)
    assert q.add("block", 1) and q.add("checkpoint", 2, persist=True) and not q.add("block", 1)
    assert ("block", 1) in q and ("checkpoint", 2) in q
    assert (tmp_path / QUARANTINE_FILE).read_text() == f"checkpoint {hash_hex(2)}\n"
    again = quarantine(tmp_path)          # another process, or a restart
    assert ("checkpoint", 2) in again and ("block", 1) not in again
    again.lift("checkpoint", 2)
    assert ("checkpoint", 2) not in again and (tmp_path / QUARANTINE_FILE).read_text() == ""


def test_a_damaged_line_loses_only_its_entry_and_an_unreadable_list_is_ignored(tmp_path, caplog):
    (tmp_path / QUARANTINE_FILE).write_text(f"block {hash_hex(5)}\nblock zz\nnope {hash_hex(6)}\nblock {hash_hex(7)}\n")
    q = quarantine(tmp_path)
    assert [("block", h) in q for h in (5, 6, 7)] == [True, False, True]
    (tmp_path / QUARANTINE_FILE).unlink()
    (tmp_path / QUARANTINE_FILE).mkdir()                 # a directory where the list belongs
    with caplog.at_level(logging.WARNING, logger="kvmesh.kvstore.store.object_store"):
        assert ("block", 5) not in quarantine(tmp_path)
    assert "unreadable" in caplog.text
