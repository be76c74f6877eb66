"""KV handoffs from and to data-parallel ranks, offline: prefill DP=2+EP -> decode TP=1, TP=1 ->
DP=2+EP and DP=2+EP -> DP=2+EP, the held request on either rank, over NIXL (each rank its own
agent over its own memory, UCX on the CPU) and over the Ray fallback (the holding rank's tensors
relayed through rank 0): greedy tokens equal a cold TP=1 run on prompts crossing many blocks
of all three layer types. A completed READ frees the holding rank's blocks (its agent gets the
notification); an offer from another engine is refused before anything is allocated.

One engine of each shape for the module (DP=2 prefill, DP=2 decode, TP=1 both ways) and the
session's local Ray (for the Ray copies)."""
from __future__ import annotations

import time

import pytest

from kvmesh.cluster.serve.transfer import Loader, RayTransport
from kvmesh.kvstore.transfer.kv_transport import HandoffError, Offer
from tests.helpers import BLOCK_TOKENS, random_prompt, tiny_engine, write_tiny_checkpoint
from kvmesh.workers.request import FirstToken, Resume
from kvmesh.workers.sampling.params import SamplingParams

pytestmark = pytest.mark.slow     # a private Ray and gloo ranks

NAME = "swa_csa_hca"
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
DP = dict(data_parallel_size=2, enable_expert_parallel=True)


@pytest.fixture(scope="module")
def engines(tmp_path_factory, local_serve):
    """{"dp_prefill", "dp_decode", "tp1"}: (engine, its NIXL transport, its RayTransport)."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("m"), NAME)
    made = {"dp_prefill": tiny_engine(path, NAME, **DP), "dp_decode": tiny_engine(path, NAME, **DP),
            "tp1": tiny_engine(path, NAME)}
    out = {}
    for key, e in made.items():
        nixl = e.open_nixl(f"test-dp-handoff-{key}", "127.0.0.1", "UCX", 10.0)
        assert nixl is not None, "NIXL (UCX) must run here"
        out[key] = (e, nixl, RayTransport(e.fingerprint, timeout_s=10.0))
    yield out
    for e, nixl, _ in out.values():
        e.close()


def run(engine) -> list:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def on(engine, rank):
    return {} if rank is None else {"rank": rank}


def prefill(src, rid: str, prompt: list[int], rank: int | None):
    engine, *_ = src
    engine.add_request(rid, prompt, GREEDY, hold_kv=True, **on(engine, rank))
    first = [o for o in run(engine) if o.request_id == rid][-1]
    assert first.held and engine.is_held(rid)
    return first


def counters() -> dict:
    return {"nixl_bytes": 0, "ray_bytes": 0, "fallbacks": 0, "handoff_reused_blocks": 0, "handoff_saved_bytes": 0}


def decode(dst, rid, prompt, first, offer, rng_state, rank, kinds):
    engine, nixl, ray_t = dst
    transports = {t.name: t for t in (nixl if "nixl" in kinds else None, ray_t) if t is not None}
    loader = Loader(offer, transports, None, counters())
    resume = Resume(first.first, loader, first.cached_tokens, rng_state)
    engine.add_request(rid, prompt, GREEDY, resume=resume, **on(engine, rank))
    done = [o for o in run(engine) if o.request_id == rid and o.finished][-1]
    return done, loader


def holder_stats(engine, rank):
    """The holding rank's stats now (a flush tick reports every rank's)."""
    if rank is None:
        return engine.stats()
    engine.flush()
    return engine.rank_stats[rank]


def released(src, rid, timeout_s=10.0) -> None:
    """Wait for the READ's notification on the holding rank's agent; it frees the cache."""
    engine, nixl, _ = src
    deadline = time.monotonic() + timeout_s
    read = []
    while rid not in read and time.monotonic() < deadline:
        read += engine.release_read(nixl)
        time.sleep(0.01)
    assert rid in read and not engine.is_held(rid)


ROUTES = [("dp_prefill", 0, "tp1", None), ("dp_prefill", 1, "tp1", None), ("tp1", None, "dp_decode", 1),
          ("dp_prefill", 1, "dp_decode", 1), ("dp_prefill", 0, "dp_decode", 1), ("dp_prefill", 1, "dp_decode", 0)]


@pytest.mark.parametrize("transport", ["nixl", "ray"])
@pytest.mark.parametrize("route", ROUTES, ids=lambda r: f"{r[0]}{r[1] if r[1] is not None else ''}-"
                                                       f"{r[2]}{r[3] if r[3] is not None else ''}")
def test_a_handoff_between_any_ranks_equals_a_cold_tp1_run_and_frees_the_holding_rank(engines, route, transport):
    src_key, src_rank, dst_key, dst_rank = route
    src, dst = engines[src_key], engines[dst_key]
    seed = 100 + 10 * ROUTES.index(route) + (transport == "ray")
    prompt = random_prompt(7 * BLOCK_TOKENS[NAME] + 5, seed=seed)           # 8 blocks, the last partial
    cold = engines["tp1"][0].generate([prompt], GREEDY)[0]
    rid = f"h{seed}"
    first = prefill(src, rid, prompt, src_rank)
    engine = src[0]
    held = engine.held_handle(rid)
    assert len(held.block_ids) == 8 and holder_stats(engine, src_rank).held == 1
    offer = engine.offer_held(rid, src[1] if transport == "nixl" else src[2])
    if transport == "nixl":
        assert offer.location.agent_name.endswith(f"-dp{src_rank}") == (src_rank is not None)
    else:
        engine.release_held(rid)                  # a Ray copy is a copy: prefill frees at once (pools._export)
    done, loader = decode(dst, rid, prompt, first, offer, held.rng_state, dst_rank, [transport])
    assert done.token_ids == cold.token_ids and done.finish_reason == "length"
    report = loader.report
    # the cold run left its 7 whole blocks in tp1's pool: decode reuses them (a Ray copy still travels whole)
    assert report.reused_blocks == (7 if dst_key == "tp1" else 0)
    moved = offer.nbytes - (report.saved_bytes if transport == "nixl" else 0)
    assert report.transport == transport and report.nbytes == moved > 0
    assert loader.counters[f"{transport}_bytes"] == moved and loader.counters["fallbacks"] == 0
    if transport == "nixl":
        released(src, rid)
    after = holder_stats(engine, src_rank)
    assert after.held == 0 and after.free_blocks == after.total_blocks
    assert holder_stats(dst[0], dst_rank).held == 0


@pytest.mark.parametrize("transport", ["nixl", "ray"])
def test_a_decode_rank_holding_the_prefix_reuses_it_and_reads_only_the_rest(engines, transport):
    src, dst = engines["dp_prefill"], engines["dp_decode"]
    prompt = random_prompt(7 * BLOCK_TOKENS[NAME] + 5, seed=300 + (transport == "ray"))
    cold = engines["tp1"][0].generate([prompt], GREEDY)[0]
    dst[0].add_request("warm" + transport, prompt[:-3], GREEDY, rank=1)      # rank 1 now holds the 7 whole blocks
    run(dst[0])
    rid = f"reuse-{transport}"
    first = prefill(src, rid, prompt, 0)
    held = src[0].held_handle(rid)
    offer = src[0].offer_held(rid, src[1] if transport == "nixl" else src[2])
    if transport == "ray":
        src[0].release_held(rid)
    done, loader = decode(dst, rid, prompt, first, offer, held.rng_state, 1, [transport])
    assert done.token_ids == cold.token_ids
    assert loader.report.reused_blocks == 7 and loader.counters["handoff_reused_blocks"] == 7
    assert loader.report.nbytes == offer.nbytes - (loader.report.saved_bytes if transport == "nixl" else 0)
    if transport == "nixl":
        released(src, rid)


def test_an_offer_from_another_engine_is_refused_before_a_rank_allocates(engines):
    engine, nixl, ray_t = engines["dp_decode"]
    prompt = random_prompt(3 * BLOCK_TOKENS[NAME], seed=9)
    alien = Offer("alien", "0" * 64, 3, 1024, "ray", [None])
    resume = Resume(FirstToken(1, -0.5), Loader(alien, {"ray": ray_t}, None, counters()))
    before = holder_stats(engine, 1).free_blocks
    with pytest.raises(HandoffError, match="fingerprint"):
        engine.add_request("alien", prompt, GREEDY, resume=resume, rank=1)
    assert not engine.has_unfinished() and holder_stats(engine, 1).free_blocks == before


@pytest.mark.parametrize("copy", [True, False], ids=["ray_copy", "no_copy"])
def test_a_failed_read_on_a_rank_falls_back_to_a_ray_copy_or_fails_only_that_request(engines, copy):
    """A READ on rank 1 from an agent that is gone: rank 0 fetches prefill's Ray copy and rank 1
    starts the request again from it (cold tokens, one fallback counted); with no copy the
    request fails with the transfer's error. The rank's other request and its memory are fine."""
    engine, nixl, ray_t = engines["dp_decode"]
    src = engines["tp1"]
    prompt = random_prompt(4 * BLOCK_TOKENS[NAME] + 1, seed=11 + copy)
    cold = src[0].generate([prompt], GREEDY)[0]
    rid = f"gone{copy}"
    first = prefill(src, rid, prompt, None)
    held = src[0].held_handle(rid)
    offer = src[0].offer_held(rid, src[1])
    bad = Offer(**{**offer.__dict__, "location": type(offer.location)(
        "no-such-agent", b"not metadata", "10.255.255.1", "DRAM", offer.location.descs)})
    fetched = []

    def fetch_ray(o: Offer, reused: int) -> Offer:  # what Decode asks the prefill worker for (Prefill.export)
        fetched.append(o.request_id)
        return src[0].offer_held(rid, src[2], reused)
    c = counters()
    loader = Loader(bad, {"nixl": nixl, "ray": ray_t}, fetch_ray if copy else None, c)
    engine.add_request(rid, prompt, GREEDY, resume=Resume(first.first, loader, first.cached_tokens, held.rng_state),
                       rank=1)
    engine.add_request(f"fine{copy}", prompt, GREEDY, rank=1)
    outs = {o.request_id: o for o in run(engine) if o.finished}
    src[0].release_held(rid)
    if copy:
        assert outs[rid].token_ids == cold.token_ids and fetched == [rid]
        assert loader.report.transport == "ray" and loader.report.fallback_reason == "read_failed"
        assert c["fallbacks"] == 1 and c["ray_bytes"] == loader.report.nbytes > 0 and c["nixl_bytes"] == 0
    else:
        assert outs[rid].finish_reason == "error" and "HandoffError" in outs[rid].error
    assert outs[f"fine{copy}"].token_ids == cold.token_ids
    after = holder_stats(engine, 1)
    assert after.load == 0 and after.free_slots == after.total_slots


def test_a_failed_read_into_a_decode_engine_holding_the_prefix_fetches_a_copy_without_those_blocks(engines):
    """The Loader's own fallback (a single engine, or DP rank 0): prefill's Ray copy is asked
    for without the blocks decode holds (`Prefill.export(skip=)`), so it carries only the rest."""
    src, (engine, nixl, ray_t) = engines["dp_prefill"], engines["tp1"]
    prompt = random_prompt(6 * BLOCK_TOKENS[NAME] + 3, seed=400)
    cold = engine.generate([prompt], GREEDY)[0]                # tp1 now holds the 6 whole blocks
    first = prefill(src, "skip", prompt, 1)
    held = src[0].held_handle("skip")
    offer = src[0].offer_held("skip", src[1])
    bad = Offer(**{**offer.__dict__, "location": type(offer.location)(
        "no-such-agent", b"not metadata", "10.255.255.1", "DRAM", offer.location.descs)})
    asked = []

    def fetch_ray(o: Offer, reused: int) -> Offer:
        asked.append(reused)
        return src[0].offer_held("skip", src[2], reused)
    loader = Loader(bad, {"nixl": nixl, "ray": ray_t}, fetch_ray, counters())
    engine.add_request("skip", prompt, GREEDY, resume=Resume(first.first, loader, first.cached_tokens, held.rng_state))
    done = [o for o in run(engine) if o.request_id == "skip" and o.finished][-1]
    src[0].release_held("skip")
    assert done.token_ids == cold.token_ids and asked == [6]
    report = loader.report
    assert (report.transport, report.fallback_reason, report.reused_blocks) == ("ray", "read_failed", 6)
    assert report.nbytes == offer.nbytes - report.saved_bytes > 0        # the copy left the 6 blocks out
