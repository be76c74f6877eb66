"""The decode side of a handoff falls back to a Ray object when the NIXL READ fails,
moves the state slot with the blocks either way, and fails with one error type."""
from __future__ import annotations

import time

import pytest
import torch

from kvmesh.cluster.serve.transfer import NIXL_UNAVAILABLE, READ_FAILED, Loader, RayTransport
from kvmesh.kvstore.device.cache_tensors import CacheTensors
from kvmesh.kvstore.transfer.kv_transport import HandoffError, HeldKV, Offer
from kvmesh.kvstore.device.layout import CSA, HCA, SWA, CacheLayout, LayoutParams
from kvmesh.kvstore.transfer.nixl_transfer import KVTransferAgent, NixlTransport, RemoteKV
from tests import helpers

pytestmark = pytest.mark.slow     # a local Ray (the Ray-object fallback)

LAYOUT = CacheLayout.build(LayoutParams((SWA, CSA, HCA), head_dim=16, index_head_dim=8, csa_ratio=4,
                                        hca_ratio=128, window=32, dtype="float32"), block_tokens=128)
SRC_BLOCKS, SRC_SLOT, DST_BLOCKS, DST_SLOT = [3, 4], 1, [0, 5], 2
FP = "f" * 32


@pytest.fixture(scope="module", autouse=True)
def session_ray(local_serve):
    """RayTransport needs a Ray: the session's."""


def random_cache(seed: int) -> CacheTensors:
    return helpers.random_cache(LAYOUT, num_blocks=6, num_slots=3, seed=seed)


def ray_offer(src: CacheTensors, **kw) -> Offer:
    offer = RayTransport(FP).offer(HeldKV("r1", SRC_BLOCKS, SRC_SLOT, 200, []), src)
    return Offer(**{**offer.__dict__, **kw})


def nixl_offer(remote: RemoteKV, num_blocks: int = 2) -> Offer:
    return Offer("r1", FP, num_blocks, remote.nbytes, "nixl", remote)


def transports(agent: KVTransferAgent | None = None) -> dict:
    out = {"ray": RayTransport(FP, timeout_s=5.0)}
    if agent is not None:
        out["nixl"] = NixlTransport(agent, FP, timeout_s=5.0)
    return out


def counters() -> dict:
    return {"nixl_bytes": 0, "ray_bytes": 0, "fallbacks": 0, "handoff_reused_blocks": 0, "handoff_saved_bytes": 0}


def assert_moved(src: CacheTensors, dst: CacheTensors) -> None:
    want, got = src.gather(SRC_BLOCKS, SRC_SLOT), dst.gather(DST_BLOCKS, DST_SLOT)
    assert want.keys() == got.keys()
    assert all(torch.equal(want[k], got[k]) for k in want)


def test_failed_read_fetches_a_ray_copy_and_counts_a_fallback():
    src, dst = random_cache(0), random_cache(1)
    agent = KVTransferAgent("test-fallback-decode", dst.all_tensors())
    unreachable = RemoteKV("gone-prefill", b"not metadata", "10.255.255.1", "DRAM",
                           tuple((0, n, 0) for _, _, n in src.block_regions(SRC_BLOCKS, SRC_SLOT)))
    fetched = []

    def fetch_export(offer, reused):
        fetched.append(offer.request_id)
        return ray_offer(src)
    c = counters()
    loader = Loader(nixl_offer(unreachable), transports(agent), fetch_export, c)
    loader.load(dst, DST_BLOCKS, DST_SLOT)      # no HandoffError
    assert fetched == ["r1"]
    assert loader.report.transport == "ray" and loader.report.fallback_reason == READ_FAILED
    assert loader.report.nbytes == 2 * LAYOUT.block_bytes + LAYOUT.slot_bytes == c["ray_bytes"]
    assert c["fallbacks"] == 1 and c["nixl_bytes"] == 0
    assert_moved(src, dst)
    agent.close()


def test_payload_from_a_prefill_without_nixl_is_scattered():
    src, dst = random_cache(2), random_cache(3)
    loader = Loader(ray_offer(src, fallback_reason=NIXL_UNAVAILABLE), transports(), None, counters())
    loader.load(dst, DST_BLOCKS, DST_SLOT)
    assert loader.report.fallback_reason == NIXL_UNAVAILABLE
    assert_moved(src, dst)


def test_configured_ray_transport_is_not_a_fallback():
    src, dst = random_cache(4), random_cache(5)
    c = counters()
    loader = Loader(ray_offer(src), transports(), None, c)
    loader.load(dst, DST_BLOCKS, DST_SLOT)
    assert loader.report.fallback_reason is None and c["fallbacks"] == 0


def test_a_failed_load_raises_one_error_type_naming_the_cause():
    dst = random_cache(6)

    def fetch_export(offer, reused):
        raise RuntimeError("prefill worker is gone")
    unreachable = RemoteKV("gone", b"x", "10.255.255.1", "DRAM", ((0, 1, 0),))
    agent = KVTransferAgent("test-fallback-decode-2", dst.all_tensors())
    loader = Loader(nixl_offer(unreachable), transports(agent), fetch_export, counters())
    with pytest.raises(HandoffError) as error:
        loader.load(dst, DST_BLOCKS, DST_SLOT)
    assert "prefill worker is gone" in str(error.value)
    wrong_count = Loader(ray_offer(random_cache(7), num_blocks=3), transports(), None, counters())
    with pytest.raises(HandoffError, match="blocks"):
        wrong_count.load(dst, DST_BLOCKS, DST_SLOT)
    agent.close()


def test_an_offer_past_its_readable_time_is_not_read_and_a_read_ends_before_it():
    """Prefill frees a held cache once its offer's readable_until has passed: a READ then, or
    one still running then, would read another request's cache as this one's."""
    src, dst = random_cache(8), random_cache(9)
    source = KVTransferAgent("test-expiry-prefill", src.all_tensors())
    agent = KVTransferAgent("test-expiry-decode", dst.all_tensors())
    nixl = NixlTransport(source, FP, timeout_s=5.0)
    offer = nixl.offer(HeldKV("r1", SRC_BLOCKS, SRC_SLOT, 200, []), src)
    assert 4.0 < offer.readable_until - time.time() <= 5.0
    before = dst.gather(DST_BLOCKS, DST_SLOT)
    expired = Offer(**{**offer.__dict__, "readable_until": time.time() - 0.1})
    with pytest.raises(HandoffError, match="expired before the READ"):
        transports(agent)["nixl"].load(expired, dst, DST_BLOCKS, DST_SLOT)
    after = dst.gather(DST_BLOCKS, DST_SLOT)
    assert all(torch.equal(before[k], after[k]) for k in before)       # nothing was read
    transports(agent)["nixl"].load(offer, dst, DST_BLOCKS, DST_SLOT)
    assert_moved(src, dst)
    reads = []
    agent.read = lambda remote, regions, notif, timeout_s: reads.append(timeout_s) or 0
    soon = Offer(**{**offer.__dict__, "readable_until": time.time() + 3.0})
    transports(agent)["nixl"]._read(soon, dst, DST_BLOCKS, DST_SLOT, 0)
    assert reads and reads[0] <= 3.0 - 1.0        # the READ's deadline falls before the source may free
    agent.close()
    source.close()

