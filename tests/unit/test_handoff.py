"""Moving a prefilled request between engines (the disaggregated path without Ray):
the continuation equals a single-engine run, seeded sampling included; a failed cache
load fails only that request; with MTP speculation the decode engine drafts from its first
step exactly as a colocated run does (the MTP state travels with the handoff)."""
from __future__ import annotations

import pytest

from kvmesh.kvstore.transfer.kv_transport import GatheredTransport
from tests.helpers import (BLOCK_TOKENS, TINY_CONFIGS, random_prompt, tiny_engine, write_mtp_checkpoint,
                           write_tiny_checkpoint)
from kvmesh.workers.engine import Engine
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.request import FirstToken, Resume
from kvmesh.workers.sampling.params import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("m"), "swa_csa_hca")


def engine(model_dir, **kw) -> Engine:
    return tiny_engine(model_dir, "swa_csa_hca", **kw)


def scatter(payload):
    """A Resume.load of a gathered payload into the blocks the decode engine lacks + the slot."""
    return lambda cache, blocks, slot, reused: cache.scatter(blocks[reused:], slot, cache.skip_blocks(payload, reused))


def run(e: Engine):
    outs = []
    while e.has_unfinished():
        outs += e.step()
    return outs


def handoff(prefill: Engine, decode: Engine, prompt, params):
    prefill.add_request("r", prompt, params, hold_kv=True)
    first = run(prefill)[-1]
    assert first.finish_reason == "held"
    held = prefill.held_handle("r")
    payload = prefill.export_held("r")
    prefill.release_held("r")
    resume = Resume(first.first, scatter(payload), first.cached_tokens, held.rng_state, mtp=held.mtp)
    decode.add_request("r", prompt, params, resume=resume)
    return [o for o in run(decode) if o.finished][-1]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
                                    SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7,
                                                   ignore_eos=True)])
def test_a_handed_off_request_continues_exactly_like_a_single_engine_run(model_dir, params):
    prompt = random_prompt(75, seed=3)
    single = engine(model_dir).generate([prompt], params)[0]
    prefill, decode = engine(model_dir), engine(model_dir)
    moved = handoff(prefill, decode, prompt, params)
    assert moved.token_ids == single.token_ids
    assert prefill.blocks.num_free == prefill.blocks.num_blocks     # released after the handoff


def test_a_cache_that_fails_to_load_fails_only_its_request(model_dir):
    e = engine(model_dir)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    def broken(cache, blocks, slot, reused):
        raise OSError("transfer failed")

    e.add_request("bad", random_prompt(20), params, resume=Resume(FirstToken(5, -1.0), broken))
    e.add_request("good", random_prompt(30), params)
    outs = {o.request_id: o for o in run(e) if o.finished}
    assert outs["bad"].finish_reason == "error" and "transfer failed" in outs["bad"].error
    assert outs["good"].finish_reason == "length" and len(outs["good"].token_ids) == 4
    assert e.blocks.num_free == e.blocks.num_blocks and e.slots.num_free == e.slots.num_slots


def test_a_handoff_load_runs_off_the_step_with_its_memory_reserved_and_joins_when_it_ends(model_dir):
    """Decode role, loads off the step (the default, handoff_loads_in_flight 4): while a load is
    slow (it waits on an event), the engine keeps stepping a running request; the loading request
    holds its blocks and slot and is not in the batch; once the load ends it joins and its tokens
    equal a single engine's. A request aborted mid-load gives its memory back only after the load
    is over; a failed load fails only its request; past the in-flight limit admission waits."""
    import threading

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = random_prompt(75, seed=5)
    single = engine(model_dir).generate([prompt], params)[0]
    prefill = engine(model_dir)
    prefill.add_request("r", prompt, params, hold_kv=True)
    first = run(prefill)[-1]
    held, payload = prefill.held_handle("r"), prefill.export_held("r")
    prefill.release_held("r")
    gates = {rid: threading.Event() for rid in ("slow", "aborted", "broken", "third")}

    def gated(rid, load=scatter(payload)):
        def run_load(cache, blocks, slot, reused):
            assert threading.current_thread() is not threading.main_thread()    # off the engine's thread
            gates[rid].wait(30)
            if rid == "broken":
                raise OSError("transfer failed")
            load(cache, blocks, slot, reused)
        return run_load

    d = engine(model_dir, handoff_loads_in_flight=3)
    d.add_request("busy", random_prompt(20, seed=6), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    d.step()
    for rid in gates:
        d.add_request(rid, prompt, params, resume=Resume(first.first, gated(rid), first.cached_tokens, held.rng_state))
    free = d.blocks.num_free
    for _ in range(5):                                    # the running request steps; three loads hold memory
        outs = d.step()
        assert [o.request_id for o in outs] == ["busy"]
    assert d.kv.loading == 3 and len(d.scheduler.waiting) == 1 and d.stats().restoring == 3   # "third" waits
    assert d.slots.num_free == d.slots.num_slots - 4 and d.blocks.num_free < free
    d.abort("aborted")
    assert d.kv.landing == 1                              # its memory waits for its load
    gates["broken"].set()
    gates["slow"].set()
    gates["aborted"].set()
    gates["third"].set()
    outs = {o.request_id: o for o in run(d) if o.finished}
    assert outs["slow"].token_ids == single.token_ids and outs["third"].token_ids == single.token_ids
    assert outs["broken"].finish_reason == "error" and "transfer failed" in outs["broken"].error
    assert "aborted" not in outs and d.kv.landing == 0 and d.kv.loading == 0
    assert d.blocks.num_free == d.blocks.num_blocks and d.slots.num_free == d.slots.num_slots


def test_prefix_reuse_can_be_switched_off_for_baselines(model_dir):
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = random_prompt(70)
    on, off = engine(model_dir), engine(model_dir, prefix_reuse=False)
    assert [on.generate([prompt], params)[0].cached_tokens for _ in range(2)] == [0, 64]
    assert [off.generate([prompt], params)[0].cached_tokens for _ in range(2)] == [0, 0]


def held_forks(prefill: Engine, prompt, params):
    prefill.add_request("f", prompt, params, hold_kv=True)
    first = [o for o in run(prefill) if o.finished][-1]
    payload = prefill.export_held("f") if first.finish_reason == "held" else None
    rng = prefill.held_handle("f").rng_state if payload is not None else None
    prefill.release_held("f")
    return first, Resume(first.first, scatter(payload), first.cached_tokens, rng, tuple(first.siblings))


def test_n_forks_happen_on_the_decode_engine_after_one_prefill(model_dir):
    prompt = random_prompt(40, seed=5)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=3)
    single = engine(model_dir).generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    prefill, decode = engine(model_dir), engine(model_dir)
    first, resume = held_forks(prefill, prompt, params)
    assert first.finish_reason == "held" and [s.token for s in first.siblings] == [single.token_ids[0]] * 2
    decode.add_request("f", prompt, params, resume=resume)
    done = {o.index: o.token_ids for o in run(decode) if o.finished}
    assert done == {0: single.token_ids, 1: single.token_ids, 2: single.token_ids}
    assert decode.blocks.num_free == decode.blocks.num_blocks and not decode.groups


def test_when_sequence_0_ends_on_its_first_token_the_other_forks_still_decode(model_dir):
    prompt = random_prompt(40, seed=6)
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True, n=3)
    probe, _ = held_forks(engine(model_dir), prompt, sampled)
    stop = probe.token_ids[0]
    assert any(s.token != stop for s in probe.siblings)
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True, n=3, stop_token_ids=(stop,))
    first, resume = held_forks(engine(model_dir), prompt, params)
    assert first.first.finish == "stop" and first.finish_reason == "held"
    decode = engine(model_dir)
    decode.add_request("f", prompt, params, resume=resume)
    done = {o.index: o for o in run(decode) if o.finished}
    going = {s.index for s in first.siblings if s.finish is None}
    assert set(done) == going and all(o.token_ids[0] == first.siblings[i - 1].token for i, o in done.items())
    assert not decode.has_unfinished() and not decode.groups


def test_a_held_request_has_the_held_status_and_is_counted_until_released(model_dir):
    e = engine(model_dir)
    e.add_request("h", random_prompt(40, seed=8), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                  hold_kv=True)
    last = run(e)[-1]
    assert last.held and last.finished and last.finish_reason == "held"
    assert e.held["h"].status.name == "HELD" and e.stats().held == 1 and not e.stats().idle
    e.release_held("h")
    assert e.stats().held == 0 and e.stats().idle


# ---- decode-side reuse: a decode engine that holds the prompt's leading blocks --------------------------
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, model_dir):
    made = {"swa_csa_hca": model_dir}

    def get(name: str):
        if name not in made:
            made[name] = write_tiny_checkpoint(tmp_path_factory.mktemp(name), name)
        return made[name]
    return get


def copy_on_demand(prefill: Engine, rid: str, reports: list):
    """A Resume.load that asks prefill for a copy of only the blocks the decode engine lacks
    (the path of Prefill.export(skip=...) after a failed READ), and keeps the transfer report."""
    transport = GatheredTransport(prefill.fingerprint)

    def load(cache, blocks, slot, reused):
        reports.append(transport.load(prefill.offer_held(rid, transport, skip=reused), cache, blocks, slot, reused))
    return load


def hand_over(prefill: Engine, decode: Engine, rid: str, prompt, params):
    """Prefill `prompt` on `prefill`, continue it on `decode`: (the final output, the transfer report)."""
    prefill.add_request(rid, prompt, params, hold_kv=True)
    first = [o for o in run(prefill) if o.request_id == rid][-1]
    reports = []
    decode.add_request(rid, prompt, params, resume=Resume(first.first, copy_on_demand(prefill, rid, reports),
                                                          first.cached_tokens, prefill.held_handle(rid).rng_state,
                                                          mtp=prefill.held_handle(rid).mtp))
    done = [o for o in run(decode) if o.finished][-1]
    prefill.release_held(rid)
    return done, reports[0]


def slot_nbytes(e: Engine) -> int:
    return sum(t[0].numel() * t.element_size() for _, kind, t in e.cache.named_tensors() if kind == "slot")


# the policy decides what a block holds (`full`: its SWA K=V too; periodic and zero: compressed entries only)
@pytest.mark.parametrize("name,policy", [("swa_csa_hca", "full"), ("swa_csa_hca", "zero"),
                                         ("csa_hca_odd_window", "full"), ("hca_yarn_wide_window", "periodic:64")])
def test_a_decode_engine_holding_the_prefix_moves_only_the_missing_blocks_and_decodes_the_same(checkpoints, name,
                                                                                             policy):
    path, bt = checkpoints(name), BLOCK_TOKENS[name]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    shared = random_prompt(5 * bt, seed=11)
    earlier, prompt = shared + random_prompt(bt + 3, seed=12), shared + random_prompt(3 * bt + 5, seed=13)
    make = lambda: tiny_engine(path, name, swa_policy=policy)  # noqa: E731
    prefill, warm, cold = make(), make(), make()
    full, full_report = hand_over(prefill, cold, "full", prompt, params)
    hand_over(prefill, warm, "earlier", earlier, params)        # warm now holds the shared 5 blocks
    reused, report = hand_over(prefill, warm, "again", prompt, params)
    assert reused.token_ids == full.token_ids
    blocks = -(-len(prompt) // bt)
    assert (full_report.reused_blocks, report.reused_blocks) == (0, 5)
    assert full_report.nbytes == blocks * warm.cache.block_nbytes + slot_nbytes(warm)
    assert report.nbytes == (blocks - 5) * warm.cache.block_nbytes + slot_nbytes(warm)
    assert report.saved_bytes == 5 * warm.cache.block_nbytes
    # a repeat of the same prompt: every full block is there, only the partial last one + the slot move
    repeat, again = hand_over(prefill, warm, "repeat", prompt, params)
    assert repeat.token_ids == full.token_ids and again.reused_blocks == len(prompt) // bt
    assert warm.blocks.num_used == 0 and warm.slots.num_free == warm.slots.num_slots


# --- MTP speculation across the handoff --------------------------------------------------------
def drafting(e: Engine) -> tuple[int, int, int]:
    c = e.counters
    return c.draft_tokens, c.accepted_draft_tokens, c.drafted_steps


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS) + ["default"])
def mtp_model(request, tmp_path_factory):
    """(engine config, prompt length) per model with an MTP layer: the tiny configs with a random
    one (blocks of 8/16/32: the prompt crosses 3-10 of them) and the built-in model, whose trained
    layer's drafts are accepted (blocks of 128, prefilled in chunks of 96 tokens)."""
    if request.param == "default":
        return EngineConfig(kv_cache_bytes=16 << 20, max_batched_tokens=96), 300
    path = write_mtp_checkpoint(tmp_path_factory, request.param)
    return EngineConfig(model=str(path), block_tokens=BLOCK_TOKENS[request.param], kv_cache_bytes=8 << 20), 83


def test_decode_drafts_from_its_first_step_after_a_handoff_like_a_colocated_run(mtp_model):
    """The prefill engine's MTP state (the layer's ring over the prompt, its drafts after the first
    token) comes with the handoff: the decode engine verifies drafts in its very first step, and
    drafts, accepts and steps exactly as the colocated engine did after its prefill."""
    config, n = mtp_model
    prompt, params = random_prompt(n, seed=11), SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    colocated = Engine(config)
    alone = colocated.generate([prompt], params)[0]
    prefill, decode = Engine(config), Engine(config)
    moved = handoff(prefill, decode, prompt, params)
    assert moved.token_ids == alone.token_ids
    assert decode.counters.handoff_draft_tokens > 0
    assert drafting(decode) == drafting(colocated) and drafting(decode)[0] > 0
    assert decode.counters.steps == colocated.counters.steps - -(-n // config.max_batched_tokens)
    if config.model is None:        # the built-in model's MTP layer is trained: its drafts are accepted
        assert drafting(decode)[1] > 0


def test_after_a_restored_prefix_decode_drafts_like_a_colocated_run_that_restored_it():
    """The second prompt shares 256 tokens (two blocks) with the first: prefill restores them, its
    MTP layer runs from there on, and decode's drafts equal those of a colocated engine that
    restored the same prefix."""
    config = EngineConfig(kv_cache_bytes=16 << 20)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first = random_prompt(300, seed=12)
    second = first[:256] + random_prompt(40, seed=13)
    colocated, prefill, decode = Engine(config), Engine(config), Engine(config)
    one = SamplingParams(max_tokens=1, temperature=0.0)      # only its cache matters
    colocated.generate([first], one)
    before = drafting(colocated)
    alone = colocated.generate([second], params)[0]
    prefill.generate([first], one)
    moved = handoff(prefill, decode, second, params)
    assert alone.cached_tokens == moved.cached_tokens == 256
    assert moved.token_ids == alone.token_ids
    assert drafting(decode) == tuple(a - b for a, b in zip(drafting(colocated), before))
    assert decode.counters.handoff_draft_tokens > 0 and drafting(decode)[1] > 0


def test_a_handoff_without_mtp_state_still_decodes_exactly():
    """A prefill engine that does not speculate hands no MTP state: decode drafts from its second
    step on (its layer's ring starts there) and the tokens are the same."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompt = random_prompt(150, seed=14)
    alone = Engine(EngineConfig(kv_cache_bytes=16 << 20, speculative_tokens=0)).generate([prompt], params)[0]
    prefill = Engine(EngineConfig(kv_cache_bytes=16 << 20, speculative_tokens=0))
    decode = Engine(EngineConfig(kv_cache_bytes=16 << 20))
    moved = handoff(prefill, decode, prompt, params)
    assert moved.token_ids == alone.token_ids
    assert decode.counters.handoff_draft_tokens == 0 and decode.counters.draft_tokens > 0
