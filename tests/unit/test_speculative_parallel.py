"""MTP speculation in the parallel engines on the CPU (gloo): TP=2 and DP=2+EP engines draft
with the checkpoint's MTP layer by default (the built-in model's: trained, so drafts are often
right), give TP=1's greedy tokens without drafts,
and draft and accept exactly what one process drafts and accepts on the same prompts: requests
arriving while others decode, prompts prefilled in chunks beside drafted steps, a DP rank with no
requests (it joins the MTP layer's expert exchanges with none), k = 1, 2 (chained passes) and auto
(k by the batch; a DP rank's batches differ from one process's, so there only the tokens are compared).
Each rank's acceptance is in `rank_stats` and /metrics (`kvmesh_rank_spec_acceptance_rate`), and
EPLB's imbalance and rebalance count in /metrics (`kvmesh_worker_eplb_*`). At k = 2 the DP engine also
runs EPLB (redundant experts, rebalancing every 4 steps: the MTP layer's experts move too) and still
drafts and accepts exactly what one process does. After a handoff (one process prefills, TP=2 decodes;
a DP rank prefills, one process decodes) the decode engine drafts from its first step with one
process's counts: the MTP state travels in the HeldKV / Resume."""
from __future__ import annotations

import pytest

from kvmesh.kvstore.transfer.kv_transport import GatheredTransport
from tests.helpers import random_prompt
from kvmesh.workers.engine import open_engine
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.request import Resume
from kvmesh.workers.sampling.params import SamplingParams

pytestmark = pytest.mark.slow     # gloo process groups: rank 1 is a spawned process

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = ["In the beginning God created", "And the LORD spake unto Moses, saying,",
           "Blessed are the poor in spirit: for theirs is the kingdom of heaven. Blessed are they",
           "The earth was without form"]
CHUNK = dict(max_batched_tokens=7)                     # prefill in chunks of 7 tokens beside verify rows
DP = dict(data_parallel_size=2, enable_expert_parallel=True)
EPLB = dict(enable_eplb=True, eplb_config=dict(num_redundant_experts=2, window_size=8, step_interval=4))
PARALLEL = {"tp2": dict(tensor_parallel_size=2),             # auto (the default): TP=1's batches, TP=1's k
            "dp2": DP,                                        # auto: a rank's batches are not TP=1's
            "dp2_k1": dict(DP, speculative_tokens=1), "dp2_k2": dict(DP, speculative_tokens=2, **EPLB)}


def engine_with(**kw):
    """An engine on the built-in model (it has an MTP layer), 16 MiB of KV cache per rank."""
    return open_engine(EngineConfig(kv_cache_bytes=16 << 20, **kw))


def staggered(engine) -> list[list[int]]:
    """PROMPTS' greedy tokens, each request added after the previous one ran 3 steps."""
    done = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
        for _ in range(3):
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return [done[f"r{i}"] for i in range(len(PROMPTS))]


def drafted(engine) -> tuple[int, int]:
    """(draft tokens, accepted) over every rank."""
    return (sum(s.counters.draft_tokens for s in engine.rank_stats),
            sum(s.counters.accepted_draft_tokens for s in engine.rank_stats))


@pytest.fixture(scope="module")
def reference():
    """TP=1: greedy tokens without drafts; (drafted, accepted) with k = 1, 2 and auto."""
    plain = staggered(engine_with(speculative_tokens=0, **CHUNK))
    counts = {}
    for k in (1, 2, "auto"):
        engine = engine_with(speculative_tokens=k, **CHUNK)
        assert staggered(engine) == plain
        counts[k] = drafted(engine)
    return plain, counts


@pytest.mark.parametrize("variant", sorted(PARALLEL))
def test_parallel_engines_draft_with_mtp_and_equal_one_process(reference, variant):
    plain, counts = reference
    kw = PARALLEL[variant]
    engine = engine_with(**kw, **CHUNK)
    try:
        rank0 = getattr(engine, "local", engine)                  # a DataParallelEngine's own rank
        k = kw.get("speculative_tokens", "auto")                  # auto: the default with an MTP layer
        assert rank0.config.speculative_tokens == k and rank0.speculator is not None
        assert staggered(engine) == plain
        total, accepted = drafted(engine)
        assert 0 < accepted < total
        if "enable_eplb" in kw:
            assert engine.stats().eplb.rebalances >= 2
        if variant != "dp2":
            assert (total, accepted) == counts[k]
        else:
            ranks = [s.counters.draft_tokens for s in engine.rank_stats]
            assert all(ranks), ranks                              # both ranks drafted for their own requests
            steps = [s.counters.steps for s in engine.rank_stats]
            alone = engine.generate(PROMPTS[2:3], GREEDY)         # one request: the other rank only exchanges
            assert alone[0].token_ids == plain[2]
            ran = [s.counters.steps - b for s, b in zip(engine.rank_stats, steps)]
            assert sorted(ran)[0] == 0 < sorted(ran)[1]
        if variant in ("tp2", "dp2"):
            handed_off_like_one_process(engine, variant)
    finally:
        engine.close()


def counts(engine) -> tuple[int, ...]:
    """(draft tokens, accepted, drafted sequence-steps, drafts that came with handoffs) over every rank."""
    return tuple(sum(getattr(s.counters, f) for s in engine.rank_stats)
                 for f in ("draft_tokens", "accepted_draft_tokens", "drafted_steps", "handoff_draft_tokens"))


def handed_off_like_one_process(engine, variant: str) -> None:
    """`engine` decodes a request one process prefilled (tp2: every rank writes the handed-off MTP
    ring) or prefills one on its rank 1 for one process to decode (dp2: the MTP state crosses the
    replica's channel): the decode side drafts from its first step, as one process alone does."""
    prompt, params = random_prompt(300, vocab=2000, seed=7), SamplingParams(max_tokens=16, temperature=0.0,
                                                                             ignore_eos=True)
    alone = engine_with()
    want = alone.generate([prompt], params)[0].token_ids
    prefill, decode = (engine_with(), engine) if variant == "tp2" else (engine, engine_with())
    prefill.add_request("h", prompt, params, hold_kv=True, **({"rank": 1} if variant == "dp2" else {}))
    outs = []
    while prefill.has_unfinished():
        outs += prefill.step()
    first = next(o for o in outs if o.held)
    held, t = prefill.held_handle("h"), GatheredTransport(prefill.fingerprint)
    offer = prefill.offer_held("h", t)
    prefill.release_held("h")
    before = counts(decode)
    decode.add_request("h", prompt, params, resume=Resume(first.first, lambda c, b, s, r: t.load(offer, c, b, s, r),
                                                          first.cached_tokens, held.rng_state, mtp=held.mtp))
    out = {}
    while decode.has_unfinished():
        out.update({o.request_id: o.token_ids for o in decode.step() if o.finished})
    drafting = tuple(a - b for a, b in zip(counts(decode), before))
    assert out["h"] == want and drafting[3] > 0
    assert drafting[:3] == counts(alone)[:3] and drafting[1] > 0


def test_each_ranks_acceptance_is_in_rank_stats_and_metrics():
    from kvmesh.cluster.messages import WorkerStats
    from kvmesh.cluster.serve.metrics import WorkerSnapshots
    engine = engine_with(**PARALLEL["dp2"], **EPLB)
    try:
        engine.generate(PROMPTS, GREEDY)
        snapshots = WorkerSnapshots()
        snapshots.update(WorkerStats("decode", "w0", engine.stats(), ranks=tuple(engine.rank_stats)))
        exported = {(s.labels["rank"]): s.value for m in snapshots.collect()
                    if m.name == "kvmesh_rank_spec_acceptance_rate" for s in m.samples}
        want = {str(r): s.as_dict()["spec_acceptance_rate"] for r, s in enumerate(engine.rank_stats)}
        assert exported == pytest.approx(want) and all(s.counters.draft_tokens for s in engine.rank_stats)
        eplb = {m.name: m.samples[0].value for m in snapshots.collect() if m.name.startswith("kvmesh_worker_eplb_")}
        stats = engine.stats().eplb
        assert eplb["kvmesh_worker_eplb_rebalances"] == stats.rebalances >= 2
        assert eplb["kvmesh_worker_eplb_imbalance"] == pytest.approx(stats.imbalance) and stats.imbalance >= 1
        assert eplb["kvmesh_worker_eplb_imbalance_static"] == pytest.approx(stats.imbalance_static)
    finally:
        engine.close()
