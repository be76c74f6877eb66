"""One KV transport interface, two implementations (NIXL, Ray objects): `offer(held, cache)`
then `load(offer, cache, block_ids, slot)` moves blocks + the state slot exactly (a destination
that holds the leading blocks moves only the rest), every failure is a HandoffError, and an
offer from an engine with another fingerprint is refused."""
from __future__ import annotations

import contextlib
import itertools
import pickle

import pytest
import ray
import torch

from kvmesh.cluster.serve.transfer import RayTransport
from kvmesh.kvstore.device.cache_tensors import CacheTensors
from kvmesh.kvstore.transfer.kv_transport import HandoffError, HeldKV, KVTransport, Offer
from kvmesh.kvstore.device.layout import CSA, HCA, SWA, CacheLayout, LayoutParams
from kvmesh.kvstore.transfer.nixl_transfer import KVTransferAgent, NixlTransport
from tests import helpers
from tests.helpers import random_prompt, tiny_engine, write_tiny_checkpoint
from kvmesh.workers.request import Resume
from kvmesh.workers.sampling.params import SamplingParams

pytestmark = pytest.mark.slow     # a local Ray (the Ray-object transport)

pytest.importorskip("nixl._api")

LAYOUT = CacheLayout.build(LayoutParams((SWA, CSA, HCA), head_dim=16, index_head_dim=8, csa_ratio=4,
                                        hca_ratio=128, window=32, dtype="float32"), block_tokens=128)
SRC_BLOCKS, SRC_SLOT, DST_BLOCKS, DST_SLOT = [3, 4], 1, [0, 5], 2
FP, OTHER_FP = "a" * 32, "b" * 32
HELD = HeldKV("r1", SRC_BLOCKS, SRC_SLOT, 200, [])
_names = itertools.count()


@pytest.fixture(scope="module", autouse=True)
def session_ray(local_serve):
    """RayTransport needs a Ray: the session's."""


def transport(kind: str, cache: CacheTensors, fingerprint: str = FP) -> KVTransport:
    if kind == "ray":
        return RayTransport(fingerprint, timeout_s=5.0)
    return NixlTransport(KVTransferAgent(f"test-kv-transport-{next(_names)}", cache.all_tensors()), fingerprint,
                         timeout_s=5.0)


def pair(kind: str, dst_fingerprint: str = FP):
    src, dst = helpers.random_cache(LAYOUT, 6, 3, seed=0), helpers.random_cache(LAYOUT, 6, 3, seed=1)
    return src, transport(kind, src), dst, transport(kind, dst, dst_fingerprint)


@pytest.mark.parametrize("kind", ["nixl", "ray"])
def test_each_transport_moves_the_blocks_and_the_state_slot(kind):
    src, a, dst, b = pair(kind)
    offer = a.offer(HELD, src)
    assert offer.transport == kind and offer.fingerprint == FP and offer.num_blocks == 2
    assert pickle.loads(pickle.dumps(offer)).nbytes == offer.nbytes == 2 * LAYOUT.block_bytes + LAYOUT.slot_bytes
    report = b.load(offer, dst, DST_BLOCKS, DST_SLOT)
    assert (report.transport, report.nbytes, report.fallback_reason) == (kind, offer.nbytes, None)
    want, got = src.gather(SRC_BLOCKS, SRC_SLOT), dst.gather(DST_BLOCKS, DST_SLOT)
    assert all(torch.equal(want[k], got[k]) for k in want)
    a.close()
    b.close()


@pytest.mark.parametrize("kind,skip", [("nixl", 0), ("nixl", 1), ("ray", 0), ("ray", 1)])
def test_a_destination_holding_the_first_block_moves_only_the_rest_and_the_slot(kind, skip):
    src, a, dst, b = pair(kind)
    kept = dst.gather(DST_BLOCKS[:1], DST_SLOT)
    offer = a.offer(HELD, src, skip=skip)           # skip=1: a copy made knowing what the destination holds
    report = b.load(offer, dst, DST_BLOCKS, DST_SLOT, reused=1)
    moved = LAYOUT.block_bytes + LAYOUT.slot_bytes
    assert (report.nbytes, report.reused_blocks, report.saved_bytes) == (
        moved if kind == "nixl" or skip else moved + LAYOUT.block_bytes, 1, LAYOUT.block_bytes)
    want, got = src.gather(SRC_BLOCKS[1:], SRC_SLOT), dst.gather(DST_BLOCKS[1:], DST_SLOT)
    assert all(torch.equal(want[k], got[k]) for k in want)
    after = dst.gather(DST_BLOCKS[:1], DST_SLOT)
    blocks = [name for name, kind_, _ in dst.named_tensors() if kind_ == "block"]
    assert all(torch.equal(kept[k], after[k]) for k in blocks)                  # the block held stays as it was
    with pytest.raises(HandoffError, match="holds 0 of the 2 blocks") if skip else contextlib.nullcontext():
        b.load(offer, dst, DST_BLOCKS, DST_SLOT, reused=0)     # a copy without a block the destination lacks
    a.close()
    b.close()


@pytest.mark.parametrize("kind", ["nixl", "ray"])
def test_an_offer_from_an_engine_with_another_fingerprint_is_refused_before_any_copy(kind):
    src, a, dst, b = pair(kind, dst_fingerprint=OTHER_FP)
    before = dst.gather(DST_BLOCKS, DST_SLOT)
    with pytest.raises(HandoffError, match="fingerprint"):
        b.load(a.offer(HELD, src), dst, DST_BLOCKS, DST_SLOT)
    after = dst.gather(DST_BLOCKS, DST_SLOT)
    assert all(torch.equal(before[k], after[k]) for k in before)
    a.close()
    b.close()


@pytest.mark.parametrize("kind", ["nixl", "ray"])
def test_every_failure_is_a_handoff_error(kind):
    src, a, dst, b = pair(kind)
    offer = a.offer(HELD, src)
    with pytest.raises(HandoffError, match="blocks"):
        b.load(offer, dst, [0], DST_SLOT)                       # the wrong number of blocks allocated
    other = "ray" if kind == "nixl" else "nixl"
    with pytest.raises(HandoffError, match=f"a {other} offer"):
        b.load(Offer("r1", FP, 2, offer.nbytes, other, None), dst, DST_BLOCKS, DST_SLOT)
    broken = (Offer("r1", FP, 2, 1, "ray", [ray.put({"nothing": torch.zeros(1)})]) if kind == "ray" else
              Offer("r1", FP, 2, 1, "nixl", offer.location.__class__("gone", b"x", "10.255.255.1", "DRAM",
                                                                     offer.location.descs)))
    with pytest.raises(HandoffError):
        b.load(broken, dst, DST_BLOCKS, DST_SLOT)             # unreachable source / unusable object
    a.close()
    b.close()


def run(engine):
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("m"), "swa_csa_hca")


def test_engines_hand_off_over_nixl_through_the_interface_and_a_foreign_engine_refuses(model_dir):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = random_prompt(75, seed=4)
    single = tiny_engine(model_dir, "swa_csa_hca").generate([prompt], params)[0]
    prefill, decode = tiny_engine(model_dir, "swa_csa_hca"), tiny_engine(model_dir, "swa_csa_hca")
    foreign = tiny_engine(model_dir, "swa_csa_hca", swa_policy="zero")     # other layout: other fingerprint
    source = NixlTransport(KVTransferAgent("test-engine-prefill", prefill.kv_tensors()), prefill.fingerprint)
    prefill.add_request("r", prompt, params, hold_kv=True)
    first = run(prefill)[-1]
    offer = prefill.offer_held("r", source)
    for i, (engine, name) in enumerate(((foreign, "foreign"), (decode, "decode"))):
        sink = NixlTransport(KVTransferAgent(f"test-engine-{name}", engine.kv_tensors()), engine.fingerprint)
        engine.add_request("r", prompt, params, resume=Resume(
            first.first, lambda cache, blocks, slot, reused, sink=sink: sink.load(
                offer, cache, blocks, slot, reused), first.cached_tokens))
        done = [o for o in run(engine) if o.finished][-1]
        if engine is foreign:
            assert done.finish_reason == "error" and "HandoffError" in done.error and "fingerprint" in done.error
        else:
            assert done.token_ids == single.token_ids
        sink.close()
    assert source.released() == ["r"]          # decode's READ told the source it may free the cache
    prefill.release_held("r")
    # decode now holds the prompt's blocks: a prompt sharing 4 of them READs only the others + the slot
    again = prompt[:64] + random_prompt(40, seed=9)
    prefill.add_request("again", again, params, hold_kv=True)
    first = run(prefill)[-1]
    offer = prefill.offer_held("again", source)
    sink = NixlTransport(KVTransferAgent("test-engine-decode-again", decode.kv_tensors()), decode.fingerprint)
    reports = []
    decode.add_request("again", again, params, resume=Resume(
        first.first, lambda cache, blocks, slot, reused: reports.append(sink.load(offer, cache, blocks, slot, reused)),
        first.cached_tokens))
    done = [o for o in run(decode) if o.finished][-1]
    assert done.token_ids == tiny_engine(model_dir, "swa_csa_hca").generate([again], params)[0].token_ids
    assert reports[0].reused_blocks == 4 and reports[0].nbytes == offer.nbytes - 4 * decode.cache.block_nbytes
    assert source.released() == ["again"]
    prefill.release_held("again")
    sink.close()
    assert prefill.stats().idle and decode.stats().idle and foreign.stats().idle
    source.close()
