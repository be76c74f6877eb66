"""Invariant 5 under faults: whatever the store holds at an object's path (nothing, 0
bytes, a directory, a FIFO, an undeletable corrupt object, an object missing a tensor,
a forgery, another deployment's key) and whatever its namespace marker says, every
request completes with the cold run's tokens; the bad object is counted, and removed
or quarantined rather than read again."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from kvmesh.kvstore.hashing import store_namespace
from kvmesh.kvstore.store.mac import StoreKey
from kvmesh.kvstore.store.objects import decode_object, encode_object
from kvmesh.kvstore.store.object_store import FINGERPRINT_FILE
from tests.helpers import random_prompt, undeletable, write_tiny_checkpoint
from kvmesh.workers.engine import Engine, StoreUnavailable
from kvmesh.workers.engine.async_engine import AsyncEngine
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.sampling.params import SamplingParams

BT = 16
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
PROMPT = random_prompt(120, seed=3)      # 7 full blocks
KEY_A, KEY_B = "a" * 32, "b" * 32
READ_TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("m"), "swa_csa_hca")


def engine(model_dir, store=None, policy="full", **kw) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), block_tokens=BT, kv_cache_bytes=16 << 20, swa_policy=policy,
                               store=str(store) if store else None, store_read_timeout_s=READ_TIMEOUT_S, **kw))


@pytest.fixture(scope="module")
def cold(model_dir):
    return engine(model_dir).generate([PROMPT], GREEDY)[0].token_ids


def seed_store(model_dir, store: Path, policy="full", **kw) -> Engine:
    writer = engine(model_dir, store, policy, **kw)
    writer.generate([PROMPT], GREEDY)
    writer.flush()
    writer.close()
    return writer


def object_path(writer: Engine, kind: str, i: int) -> Path:
    h = writer.prefix.hasher.hashes(PROMPT)[i]
    return Path(writer.prefix.store._path(kind, h))


def drop_a_tensor(path: Path, fingerprint: str, kind: str, h: int) -> None:
    """A structurally invalid object with a *valid* checksum: one tensor left out."""
    obj = decode_object(bytearray(path.read_bytes()), fingerprint, h, kind)
    tensors = dict(list(obj.tensors.items())[1:])
    path.write_bytes(encode_object(fingerprint, kind, h, obj.parent, obj.token_count, tensors))



def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(data)


FAULTS = {
    "zero_bytes": lambda p: p.write_bytes(b""),
    "directory": lambda p: (p.unlink(), p.mkdir()),
    "fifo": lambda p: (p.unlink(), os.mkfifo(p)),
    "short_read": lambda p: p.write_bytes(p.read_bytes()[:-100]),
    "flipped_byte": corrupt,
}


@pytest.mark.parametrize("store_reader", ["nixl", "file"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_bad_file_at_an_object_path_is_a_miss_and_the_output_is_the_cold_runs(model_dir, cold, tmp_path, fault,
                                                                                  store_reader):
    writer = seed_store(model_dir, tmp_path)
    path = object_path(writer, "block", 3)
    reader = engine(model_dir, tmp_path, store_reader=store_reader)   # its index lists the good object; then it goes bad
    assert reader.prefix.store.reader == store_reader
    FAULTS[fault](path)
    out = reader.generate([PROMPT], GREEDY)[0]
    assert out.token_ids == cold and out.finish_reason == "length"
    assert out.cached_tokens == 3 * BT                 # blocks 0..2 were still good
    s = reader.prefix.store.stats()
    assert s.corrupt + s.read_errors == 1 and s.quarantined == 0
    reader.flush()
    assert path.is_file() and not path.is_symlink()      # removed once, then the recomputed block stored again
    again = engine(model_dir, tmp_path).generate([PROMPT], GREEDY)[0]
    assert again.token_ids == cold and again.cached_tokens == (len(PROMPT) - 1) // BT * BT


def test_an_undeletable_corrupt_object_is_quarantined_not_retried(model_dir, cold, tmp_path, caplog):
    writer = seed_store(model_dir, tmp_path)
    path = object_path(writer, "block", 2)
    corrupt(path)
    with undeletable(path):
        reader = engine(model_dir, tmp_path)
        with caplog.at_level(logging.WARNING, logger="kvmesh.kvstore.store.object_store"):
            outs = [reader.generate([PROMPT], GREEDY)[0] for _ in range(3)]
        assert all(o.token_ids == cold for o in outs)
        s = reader.prefix.store.stats()
        assert s.corrupt == 1 and s.quarantined == 1     # read once, never again
        assert path.exists()
        named = [r for r in caplog.records if r.name == "kvmesh.kvstore.store.object_store" and str(path) in r.getMessage()]
        assert len(named) == 2                             # the cause, then "cannot remove": once each
        restarted = engine(model_dir, tmp_path)            # the quarantine is in the store: not read again
        assert restarted.generate([PROMPT], GREEDY)[0].token_ids == cold
        assert restarted.prefix.store.stats().corrupt == 0


@pytest.mark.parametrize("kind,policy", [("block", "full"), ("checkpoint", f"periodic:{2 * BT}")])
def test_an_object_missing_a_tensor_is_a_miss_and_is_removed(model_dir, cold, tmp_path, kind, policy):
    writer = seed_store(model_dir, tmp_path, policy)
    i = 3 if kind == "block" else 6           # the checkpoint at the prompt's end is the one restored
    path = object_path(writer, kind, i)
    drop_a_tensor(path, writer.fingerprint, kind, writer.prefix.hasher.hashes(PROMPT)[i])
    reader = engine(model_dir, tmp_path, policy)
    out = reader.generate([PROMPT], GREEDY)[0]
    assert out.token_ids == cold
    assert reader.prefix.store.stats().corrupt == 1
    reader.flush()
    if path.exists():      # re-persisted by the reader's own run: must be whole again
        decode_object(bytearray(path.read_bytes()), writer.fingerprint, writer.prefix.hasher.hashes(PROMPT)[i], kind)


def test_a_corrupt_namespace_marker_is_rewritten_and_reuse_goes_on(model_dir, cold, tmp_path):
    writer = seed_store(model_dir, tmp_path)
    marker = Path(writer.prefix.store._dir) / FINGERPRINT_FILE
    marker.write_bytes(b"\xff\xfe\x00garbage\x80")
    reader = engine(model_dir, tmp_path)
    out = reader.generate([PROMPT], GREEDY)[0]
    assert out.token_ids == cold and out.cached_tokens > 0
    assert marker.read_text() == writer.fingerprint


def test_a_store_that_cannot_be_opened_degrades_to_no_reuse_unless_required(model_dir, cold, tmp_path, caplog):
    not_a_dir = tmp_path / "store"
    not_a_dir.write_text("a file where the store should be")
    with caplog.at_level(logging.WARNING, logger="kvmesh.workers.engine.builder"):
        e = engine(model_dir, not_a_dir)
    assert e.prefix.store is None and "without prefix reuse" in caplog.text
    assert e.generate([PROMPT], GREEDY)[0].token_ids == cold
    with pytest.raises(StoreUnavailable):
        engine(model_dir, not_a_dir, require_store=True)


def test_a_forged_object_with_a_valid_checksum_but_no_mac_is_never_used(model_dir, cold, tmp_path):
    writer = seed_store(model_dir, tmp_path, store_key=KEY_A)
    fp, hashes = writer.fingerprint, writer.prefix.hasher.hashes(PROMPT)
    for i in range(len(hashes)):           # the attacker rewrites every block: same names, zeros inside
        path = object_path(writer, "block", i)
        obj = decode_object(bytearray(path.read_bytes()), fp, hashes[i], "block")
        forged = {k: torch.zeros_like(t) for k, t in obj.tensors.items()}
        path.write_bytes(encode_object(fp, "block", hashes[i], obj.parent, obj.token_count, forged))
    reader = engine(model_dir, tmp_path, store_key=KEY_A)
    out = reader.generate([PROMPT], GREEDY)[0]
    assert out.token_ids == cold and out.cached_tokens == 0
    assert reader.prefix.store.stats().corrupt == len(hashes)   # each rejected and removed


def test_a_store_written_with_one_key_and_read_with_another_reuses_nothing(model_dir, cold, tmp_path):
    seed_store(model_dir, tmp_path, store_key=KEY_A)
    same = engine(model_dir, tmp_path, store_key=KEY_A).generate([PROMPT], GREEDY)[0]
    assert same.token_ids == cold and same.cached_tokens > 0
    other = engine(model_dir, tmp_path, store_key=KEY_B).generate([PROMPT], GREEDY)[0]
    assert other.token_ids == cold and other.cached_tokens == 0


def run_once(model_dir, store: Path, **kw):
    e = engine(model_dir, store, **kw)
    out = e.generate([PROMPT], GREEDY)[0]
    e.flush()
    e.close()
    return out, e.prefix.store.stats()


def test_a_node_with_a_wrong_key_costs_only_its_own_reuse(model_dir, cold, tmp_path):
    """Key one writes, key two (a typo) and an unkeyed node run, recompute and write; key
    one's next run still reuses the whole prefix: nothing of key one's was removed or overwritten."""
    seed_store(model_dir, tmp_path, store_key=KEY_A)
    for key in (KEY_B, None):
        out, stats = run_once(model_dir, tmp_path, store_key=key)
        assert out.token_ids == cold and out.cached_tokens == 0 and stats.corrupt == 0 and stats.writes > 0
    out, stats = run_once(model_dir, tmp_path, store_key=KEY_A)
    assert out.token_ids == cold and out.cached_tokens == (len(PROMPT) - 1) // BT * BT
    assert stats.corrupt == 0
    keyed = AsyncEngine(engine=engine(model_dir, tmp_path, store_key=KEY_A))      # what the ingress is told
    try:
        ns = store_namespace(keyed.fingerprint, StoreKey(KEY_A).key_id)
        assert keyed.info()["index_namespace"] == keyed.engine.prefix.index.namespace == ns
        assert keyed.engine.prefix.store.namespace == ns and KEY_A not in ns
    finally:
        keyed.shutdown()


def test_key_rotation_keeps_old_key_nodes_reusing_until_the_old_namespace_is_removed(model_dir, cold, tmp_path):
    """docs/deploy.md's rotation, step by step: new-key nodes start a namespace of their own
    while old-key nodes go on reusing theirs; once none runs the old key, `kvmesh store gc
    --namespace OLD --all` removes the old objects and nothing of the new key's."""
    from kvmesh.cluster.cli.store import main as store_cli
    full = (len(PROMPT) - 1) // BT * BT
    seed_store(model_dir, tmp_path, store_key=KEY_A)                        # before: everyone on key A
    new, _ = run_once(model_dir, tmp_path, store_key=KEY_B)                # 1. the first node on key B
    assert new.token_ids == cold and new.cached_tokens == 0
    old, _ = run_once(model_dir, tmp_path, store_key=KEY_A)                # 2. rollout: A nodes unharmed
    assert old.token_ids == cold and old.cached_tokens == full
    again, _ = run_once(model_dir, tmp_path, store_key=KEY_B)              # ... and B nodes share B's
    assert again.token_ids == cold and again.cached_tokens == full
    old_ns = engine(model_dir, tmp_path, store_key=KEY_A).prefix.store.namespace
    assert store_cli(["store", "gc", "--store", str(tmp_path), "--namespace", old_ns, "--all"]) == 0   # 3.
    assert not list((tmp_path / old_ns / "block").glob("*.kv"))
    after, _ = run_once(model_dir, tmp_path, store_key=KEY_B)
    assert after.token_ids == cold and after.cached_tokens == full
