"""Unusable store entries are dealt with once (issue 23): a malformed object with a valid
checksum takes the typed corrupt-object path; a directory, FIFO or 0-byte file at an object's
path is removed so the prefix can be stored again; an object that cannot be removed is
quarantined in the namespace's QUARANTINE file, so a restarted process does not read it again."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from kvmesh.kvstore.hashing import PrefixHasher, model_fingerprint
from kvmesh.kvstore.index.embedded import EmbeddedIndex
from kvmesh.kvstore.store.objects import (
    CHECKSUM_OFFSET,
    DATA_ALIGN,
    PREFIX_SIZE,
    PREFIX_STRUCT,
    CorruptObjectError,
    _checksum,
    decode_object,
    encode_object,
)
from kvmesh.kvstore.store.object_store import QUARANTINE_FILE, ObjectStore
from tests.helpers import undeletable

FP = model_fingerprint({"model_type": "deepseek_v4"}, "w0", "bfloat16", 4, 1)
HS = PrefixHasher(FP, 4).hashes(list(range(16)))
TENSORS = {"kv": torch.arange(32, dtype=torch.float32).view(4, 8)}


def reframed(mutate) -> bytes:
    """A block object whose JSON header `mutate` changed, with a *valid* checksum."""
    raw = encode_object(FP, "block", HS[0], None, 4, TENSORS)
    _, version, header_len, _ = PREFIX_STRUCT.unpack_from(raw)
    header = json.loads(raw[PREFIX_SIZE:PREFIX_SIZE + header_len])
    data = raw[-header["data_length"]:]
    mutate(header)
    text = json.dumps(header).encode()
    pad = -(PREFIX_SIZE + len(text)) % DATA_ALIGN
    body = [text, bytes(pad), data]
    head = PREFIX_STRUCT.pack(b"KVMESH01", version, len(text), 0)
    return PREFIX_STRUCT.pack(b"KVMESH01", version, len(text), _checksum(head[:CHECKSUM_OFFSET], body)) + b"".join(body)


MALFORMED = {
    "tensor name a list": lambda h: h["tensors"][0].update(name=["kv"]),
    "shape a dict": lambda h: h["tensors"][0].update(shape={"a": 1}),
    "tensors a dict": lambda h: h.update(tensors={"kv": 1}),
    "tensor entry a number": lambda h: h.update(tensors=[7]),
    "hash a number": lambda h: h.update(hash=12),
    "token_count a list": lambda h: h.update(token_count=[4]),
    "header empty": lambda h: h.clear(),
}


@pytest.mark.parametrize("what", list(MALFORMED))
def test_a_malformed_object_with_a_valid_checksum_is_a_corrupt_object(what):
    with pytest.raises(CorruptObjectError):
        decode_object(bytearray(reframed(MALFORMED[what])), FP, HS[0], "block")


def store(root: Path) -> tuple[ObjectStore, EmbeddedIndex]:
    index = EmbeddedIndex(FP)
    return ObjectStore(str(root), FP, index=index), index


def path_of(s: ObjectStore, h: int) -> Path:
    return Path(s._path("block", h))


def test_a_malformed_object_is_counted_corrupt_and_removed_by_the_store(tmp_path):
    s, index = store(tmp_path)
    s.put("block", HS[0], None, 4, TENSORS)
    path_of(s, HS[0]).write_bytes(reframed(MALFORMED["tensor name a list"]))
    assert s.get("block", HS[0]) is None
    assert s.stats().corrupt == 1 and not path_of(s, HS[0]).exists() and index.lookup(HS[:1]).stored == 0


BAD_ENTRIES = {
    "directory": lambda p: (p.unlink(), p.mkdir(), (p / "x").write_text("x")),
    "fifo": lambda p: (p.unlink(), os.mkfifo(p)),
    "zero_bytes": lambda p: p.write_bytes(b""),
}


@pytest.mark.parametrize("what", list(BAD_ENTRIES))
def test_an_unusable_entry_is_removed_once_and_the_prefix_can_be_stored_again(tmp_path, what):
    s, index = store(tmp_path)
    s.put("block", HS[0], None, 4, TENSORS)
    BAD_ENTRIES[what](path_of(s, HS[0]))
    assert s.get("block", HS[0]) is None and s.stats().quarantined == 0
    assert not os.path.lexists(path_of(s, HS[0]))
    s.put("block", HS[0], None, 4, TENSORS)                          # recomputed and stored again
    assert torch.equal(s.get("block", HS[0]).tensors["kv"], TENSORS["kv"]) and index.lookup(HS[:1]).stored == 1



def test_the_quarantine_of_an_undeletable_object_survives_a_restart(tmp_path):
    s, _ = store(tmp_path)
    for h in HS[:2]:
        s.put("block", h, None, 4, TENSORS)
    bad = path_of(s, HS[0])
    bad.write_bytes(bad.read_bytes()[:-3])
    with undeletable(bad):
        assert s.get("block", HS[0]) is None and s.stats().quarantined == 1
        again, index = store(tmp_path)                                # a restart, or another process
        assert again.get("block", HS[0]) is None
        assert again.stats().corrupt == 0 and again.stats().misses == 1   # not read at all
        assert again.list("block") == [HS[1]] and index.lookup(HS[:1]).stored == 0   # never published
    healed, _ = store(tmp_path)            # once it can be replaced, a put lifts the quarantine
    healed.put("block", HS[0], None, 4, TENSORS)
    assert (tmp_path / FP[:16] / QUARANTINE_FILE).read_text() == ""
    assert store(tmp_path)[0].get("block", HS[0]) is not None
