"""NIXL (UCX) handoff of cache blocks + a state slot between two agents, without Ray."""
from __future__ import annotations

import sys

import pytest
import torch

from kvmesh.kvstore.device.cache_tensors import CacheTensors
from kvmesh.kvstore.device.layout import CSA, HCA, SWA, CacheLayout, LayoutParams
from kvmesh.kvstore.transfer.nixl_transfer import KVTransferAgent, RemoteKV, TransferError, coalesce, make_agent
from tests import helpers

pytest.importorskip("nixl._api")

LAYOUT = CacheLayout.build(LayoutParams((SWA, CSA, HCA, CSA), head_dim=16, index_head_dim=8, csa_ratio=4,
                                        hca_ratio=128, window=32, dtype="float32"), block_tokens=128)


def random_cache(seed: int) -> CacheTensors:
    return helpers.random_cache(LAYOUT, num_blocks=8, num_slots=3, seed=seed)


@pytest.fixture(scope="module")
def pair():
    src, dst = random_cache(0), random_cache(1)
    a = KVTransferAgent("test-prefill", src.all_tensors())
    b = KVTransferAgent("test-decode", dst.all_tensors())
    yield src, a, dst, b
    a.close()
    b.close()


def wait_notifs(agent: KVTransferAgent, timeout_s: float = 5.0) -> list[bytes]:
    import time
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = agent.notifications()
        if got:
            return got
        time.sleep(0.01)
    return []


def test_read_moves_blocks_and_state_slot_and_notifies_source(pair):
    src, a, dst, b = pair
    remote = a.describe(src.block_regions([5, 2, 3], 1))
    nbytes = b.read(remote, dst.block_regions([0, 1, 7], 2), notif=b"release:r1")
    assert nbytes == remote.nbytes == 3 * LAYOUT.block_bytes + LAYOUT.slot_bytes
    want, got = src.gather([5, 2, 3], 1), dst.gather([0, 1, 7], 2)
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert wait_notifs(a) == [b"release:r1"]


def test_read_leaves_other_blocks_untouched(pair):
    src, a, dst, b = pair
    before = dst.gather([4, 6], 0)
    b.read(a.describe(src.block_regions([1], 0)), dst.block_regions([3], 1))
    after = dst.gather([4, 6], 0)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_remote_description_travels_as_plain_data(pair):
    import pickle
    src, a, _, _ = pair
    remote = a.describe(src.block_regions([0], 0))
    assert pickle.loads(pickle.dumps(remote)) == remote


def test_mismatched_regions_are_a_transfer_error(pair):
    src, a, dst, b = pair
    with pytest.raises(TransferError):
        b.read(a.describe(src.block_regions([0, 1], 0)), dst.block_regions([0], 0))


def test_unreachable_source_is_a_transfer_error(pair):
    src, a, dst, b = pair
    real = a.describe(src.block_regions([0], 0))
    bogus = RemoteKV("no-such-agent", b"not metadata", "10.255.255.1", "DRAM", real.descs)
    with pytest.raises(TransferError):
        b.read(bogus, dst.block_regions([0], 0), timeout_s=2.0)


def test_coalesce_merges_runs_contiguous_on_both_sides():
    local = [(100, 10, 0), (110, 10, 0), (200, 10, 0)]
    remote = [(500, 10, 0), (510, 10, 0), (520, 10, 0)]
    assert coalesce(local, remote) == ([(100, 20, 0), (200, 10, 0)], [(500, 20, 0), (520, 10, 0)])


def test_missing_nixl_means_no_agent_and_a_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl._api", None)   # import fails as if not installed
    agent, reason = make_agent("test-nonixl", [torch.zeros(4)], "127.0.0.1")
    assert agent is None and "nixl" in reason
