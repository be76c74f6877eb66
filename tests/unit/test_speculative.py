"""Speculative decoding: greedy output is exactly the non-speculative output whatever the
drafts say, with the state of rejected drafts rolled back across window, compressor-window
and block boundaries; accepted drafts cut the number of steps."""
from __future__ import annotations

import random

import pytest

from tests.helpers import (BLOCK_TOKENS, TINY_CONFIGS, random_prompt, tiny_engine, write_mtp_checkpoint,
                           write_tiny_checkpoint)
from kvmesh.workers.engine import Engine
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.sampling.params import SamplingParams
from kvmesh.workers.spec.speculative import DraftLimits, OracleDrafter

MAX_TOKENS = 30     # crosses windows of 6/8/24, compressor windows of 4/8/16 and blocks of 8/16/32
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
PROMPT_LENS = (5, 13, 22)


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def checkpoint(request, tmp_path_factory):
    name = request.param
    return name, write_tiny_checkpoint(tmp_path_factory.mktemp(name), name)



def prompts() -> list[list[int]]:
    return [random_prompt(n, seed=100 + n) for n in PROMPT_LENS]


def corrupt(tokens: list[int], rate: float, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [(t + 1) % 300 if rng.random() < rate else t for t in tokens]


@pytest.fixture(scope="module")
def cold(checkpoint):
    name, path = checkpoint
    engine = tiny_engine(path, name)
    outs = engine.generate(prompts(), GREEDY)
    return [o.token_ids for o in outs], engine.counters.steps


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("wrong", [0.0, 0.3, 1.0])
def test_speculative_greedy_equals_plain_greedy(checkpoint, cold, k, wrong):
    name, path = checkpoint
    ref, plain_steps = cold
    engine = tiny_engine(path, name)
    engine.set_drafter(OracleDrafter({tuple(p): corrupt(r, wrong, seed=k) for p, r in zip(prompts(), ref)}), k)
    outs = engine.generate(prompts(), GREEDY)
    assert [o.token_ids for o in outs] == ref
    s = engine.counters
    assert s.draft_tokens > 0
    if wrong == 0.0:
        assert s.accepted_draft_tokens == s.draft_tokens
        assert s.steps < plain_steps
    elif wrong == 1.0:
        assert s.accepted_draft_tokens == 0
    else:
        assert 0 < s.accepted_draft_tokens < s.draft_tokens


def test_seeded_sampling_with_drafts_equals_seeded_sampling_without(checkpoint):
    """Under temperature > 0 each emitted token is still one draw from the target distribution
    of its row (accepted drafts are draws that happened to equal the draft), in the same order,
    so a seeded run gives the same tokens with or without speculation."""
    name, path = checkpoint
    sampled = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_k=50, seed=5, ignore_eos=True)
    plain = [o.token_ids for o in tiny_engine(path, name).generate(prompts(), sampled)]
    engine = tiny_engine(path, name)
    engine.set_drafter(OracleDrafter({tuple(p): corrupt(r, 0.3, seed=3) for p, r in zip(prompts(), plain)}), 3)
    assert [o.token_ids for o in engine.generate(prompts(), sampled)] == plain
    assert 0 < engine.counters.accepted_draft_tokens < engine.counters.draft_tokens


def test_seeded_forks_with_drafts_equal_seeded_forks_without(checkpoint):
    """n > 1: each fork draws from its own generator, drafts or not (the oracle holds fork 0's
    tokens, so the other forks' drafts are mostly rejected)."""
    name, path = checkpoint
    forks = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=11, n=3, ignore_eos=True)
    plain = [o.token_ids for o in tiny_engine(path, name).generate(prompts(), forks)]
    engine = tiny_engine(path, name)
    engine.set_drafter(OracleDrafter({tuple(p): corrupt(plain[3 * i], 0.3, seed=4)
                                      for i, p in enumerate(prompts())}), 3)
    assert [o.token_ids for o in engine.generate(prompts(), forks)] == plain
    assert 0 < engine.counters.accepted_draft_tokens < engine.counters.draft_tokens


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("wrong_at", ["window_close", 0, 1, 2])
def test_drafts_rejected_at_each_position_are_rolled_back(checkpoint, cold, k, wrong_at, monkeypatch):
    """Drafts that are wrong exactly where a compressor window closes (the draft closed it: its
    entry, tail and overlap state must not survive), or at one output position in three (offset
    0, 1 or 2: steps of k = 3 reject their first, second or third draft): greedy output is the
    cold output, and window-closing drafts were really proposed."""
    from kvmesh.workers.spec import speculative
    name, path = checkpoint
    ref, _ = cold
    engine = tiny_engine(path, name)
    m = engine.args.csa_ratio

    def bad(position: int, i: int) -> bool:
        return (position + 1) % m == 0 if wrong_at == "window_close" else i % 3 == wrong_at
    closing = []
    save = speculative.Speculator.save

    def spy(self, batch, drafts):
        state = save(self, batch, drafts)
        closing.append(len(state.closing))
        return state
    monkeypatch.setattr(speculative.Speculator, "save", spy)
    oracle = {tuple(p): [(t + 1) % 300 if bad(len(p) + i, i) else t for i, t in enumerate(r)]
              for p, r in zip(prompts(), ref)}
    engine.set_drafter(OracleDrafter(oracle), k)
    assert [o.token_ids for o in engine.generate(prompts(), GREEDY)] == ref
    assert sum(closing) > 0
    assert 0 < engine.counters.accepted_draft_tokens < engine.counters.draft_tokens


@pytest.mark.parametrize("policy", ["full", "periodic"])
def test_speculative_run_leaves_a_cache_that_later_requests_reuse_exactly(checkpoint, cold, policy):
    """Blocks written while drafts were rolled back are hashed and restored by the next
    request with the same prefix (prompt + output as the new prompt): still the cold tokens."""
    name, path = checkpoint
    ref, _ = cold
    swa = f"periodic:{BLOCK_TOKENS[name]}" if policy == "periodic" else policy
    engine = tiny_engine(path, name, swa_policy=swa)
    engine.set_drafter(OracleDrafter({tuple(p): corrupt(r, 0.3, seed=7) for p, r in zip(prompts(), ref)}), 3)
    engine.generate(prompts(), GREEDY)
    follow = [p + r for p, r in zip(prompts(), ref)]
    again = engine.generate(follow, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert sum(o.cached_tokens for o in again) > 0
    fresh = tiny_engine(path, name).generate(follow, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in again] == [o.token_ids for o in fresh]


def test_drafts_stay_in_one_compressor_window_and_never_end_a_block():
    limits = DraftLimits(ratios=(4, 16), block_tokens=16, window=8)
    assert limits.max_drafts(computed=4, n_real=1, k=3) == 3     # count 5: drafts 5, 6, 7 (7 closes [4, 8))
    assert limits.max_drafts(computed=6, n_real=1, k=3) == 1     # count 7: one draft, which closes the window
    assert limits.max_drafts(computed=7, n_real=1, k=3) == 3     # count 8 (a window just closed)
    assert limits.max_drafts(computed=13, n_real=1, k=3) == 1    # count 14: a draft at 15 would end the block
    assert limits.max_drafts(computed=15, n_real=1, k=3) == 0    # count 16: a block just ended
    assert limits.max_drafts(computed=0, n_real=8, k=3) == 0     # the window is full of real tokens


# --- the checkpoint's MTP layer as the draft ------------------------------------------------------
@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def mtp_checkpoint(request, tmp_path_factory):
    """(block size, directory) of `write_mtp_checkpoint`, for every tiny config."""
    return BLOCK_TOKENS[request.param], write_mtp_checkpoint(tmp_path_factory, request.param)


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_drafts_leave_greedy_output_unchanged(mtp_checkpoint, k):
    block, path = mtp_checkpoint

    def run(spec: int):
        e = Engine(EngineConfig(model=str(path), block_tokens=block, kv_cache_bytes=8 << 20,
                                speculative_tokens=spec))
        return [o.token_ids for o in e.generate(prompts(), GREEDY)], e.counters
    plain, _ = run(0)
    spec, stats = run(k)
    assert spec == plain
    assert stats.draft_tokens > 0


def test_mtp_drafts_after_a_restored_prefix_leave_greedy_output_unchanged(mtp_checkpoint):
    """The second request restores the first one's blocks; the MTP layer never ran there."""
    block, path = mtp_checkpoint
    e = Engine(EngineConfig(model=str(path), block_tokens=block, kv_cache_bytes=8 << 20,
                            speculative_tokens=2))
    first = e.generate(prompts(), GREEDY)
    again = e.generate([p + o.token_ids for p, o in zip(prompts(), first)], GREEDY)
    assert sum(o.cached_tokens for o in again) > 0
    cold = Engine(EngineConfig(model=str(path), block_tokens=block, kv_cache_bytes=8 << 20,
                               speculative_tokens=0))
    assert [o.token_ids for o in again] == [o.token_ids for o in cold.generate(
        [p + o.token_ids for p, o in zip(prompts(), first)], GREEDY)]


def test_mtp_drafts_beside_chunked_prefills_leave_greedy_output_unchanged(mtp_checkpoint):
    """Requests arrive while others decode with drafts, and prompts are prefilled in chunks of
    7 tokens: steps mix prefill chunks with verify rows, and the MTP layer's pass runs over both."""
    block, path = mtp_checkpoint

    def run(spec: int):
        e = Engine(EngineConfig(model=str(path), block_tokens=block, kv_cache_bytes=8 << 20,
                                speculative_tokens=spec, max_batched_tokens=7))
        done = {}
        for i, prompt in enumerate(prompts()):
            e.add_request(f"r{i}", prompt, GREEDY)
            for _ in range(4):
                done.update({o.request_id: o.token_ids for o in e.step() if o.finished})
        while e.has_unfinished():
            done.update({o.request_id: o.token_ids for o in e.step() if o.finished})
        return [done[f"r{i}"] for i in range(len(PROMPT_LENS))], e.counters
    plain, _ = run(0)
    spec, stats = run(2)
    assert spec == plain
    assert stats.draft_tokens > 0


def test_speculation_is_on_by_default_with_an_mtp_layer_and_off_otherwise(tmp_path_factory):
    """speculative_tokens unset: `auto` drafts (k by the batch) when the checkpoint has `mtp.*`
    weights; none without them, none when set to 0 (tensor- and data-parallel engines:
    test_speculative_parallel.py)."""
    name = "swa_csa_hca"
    path = write_mtp_checkpoint(tmp_path_factory, name)
    plain = write_tiny_checkpoint(tmp_path_factory.mktemp("plain"), name)
    auto = tiny_engine(path, name)
    assert auto.config.speculative_tokens == "auto" and auto.speculator is not None
    out = auto.generate(prompts()[:2], GREEDY)
    assert auto.counters.draft_tokens > 0
    off = tiny_engine(path, name, speculative_tokens=0)
    assert off.speculator is None and [o.token_ids for o in off.generate(prompts()[:2], GREEDY)] == [
        o.token_ids for o in out]
    assert tiny_engine(plain, name).speculator is None


def test_a_draft_rule_picks_k_by_the_batch_and_a_bad_one_is_a_config_error():
    from kvmesh.workers.model.args import ConfigError
    from kvmesh.workers.spec.speculative import DraftRule
    rule = DraftRule.parse("1:2,2:1,16:0")
    assert [rule.for_batch(n) for n in (1, 2, 15, 16, 64)] == [2, 1, 1, 0, 0] and rule.k == 2
    assert EngineConfig(speculative_tokens="3").speculative_tokens == 3                  # a flag's string
    assert EngineConfig(speculative_tokens="auto").draft_rule(False) == DraftRule.parse(EngineConfig().speculative_auto)
    assert EngineConfig().draft_rule(False) is None and EngineConfig(speculative_tokens=2).draft_rule(False).k == 2
    for bad in (dict(speculative_tokens="many"), dict(speculative_tokens=-1), dict(speculative_auto="2:1"),
                dict(speculative_auto="1:1,4"), dict(speculative_auto="1:1,8:2,4:0")):
        with pytest.raises(ConfigError, match="speculative"):
            EngineConfig(**bad)


def test_auto_drafts_follow_the_batch_and_leave_greedy_output_unchanged(mtp_checkpoint):
    """Three requests of different lengths: batch 3 drafts nothing (the MTP layer does not run),
    batch 2 one token, batch 1 two; the layer's ring is masked where it did not run."""
    block, path = mtp_checkpoint
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (8, 18, 30)]

    def run(spec):
        e = Engine(EngineConfig(model=str(path), block_tokens=block, kv_cache_bytes=8 << 20,
                                speculative_tokens=spec, speculative_auto="1:2,2:1,3:0"))
        return [o.token_ids for o in e.generate(prompts(), params)], e
    plain, _ = run(0)
    auto, engine = run("auto")
    assert auto == plain and engine.counters.draft_tokens > engine.counters.drafted_steps > 0


def test_speculative_tokens_without_an_mtp_layer_fail_at_start_up(tmp_path):
    from kvmesh.workers.model.args import ConfigError
    path = write_tiny_checkpoint(tmp_path, "swa_csa_hca")
    with pytest.raises(ConfigError, match="MTP"):
        Engine(EngineConfig(model=str(path), block_tokens=16, kv_cache_bytes=8 << 20, speculative_tokens=1))


def test_speculation_figures_are_in_engine_stats_and_metrics(checkpoint, cold):
    """Acceptance rate, drafts per step and tokens per step follow the counters, and /metrics
    exports them as kvmesh_worker_spec_* gauges."""
    from kvmesh.cluster.messages import WorkerStats
    from kvmesh.cluster.serve.metrics import WorkerSnapshots
    name, path = checkpoint
    ref, _ = cold
    engine = tiny_engine(path, name)
    assert engine.stats().as_dict()["spec_acceptance_rate"] == 0.0
    engine.set_drafter(OracleDrafter({tuple(p): corrupt(r, 0.3, seed=2) for p, r in zip(prompts(), ref)}), 2)
    engine.generate(prompts(), GREEDY)
    c, snapshot = engine.counters, engine.stats()
    stats = snapshot.as_dict()
    assert 0 < c.drafted_steps <= c.draft_tokens <= 2 * c.drafted_steps
    assert stats["spec_acceptance_rate"] == pytest.approx(c.accepted_draft_tokens / c.draft_tokens)
    assert stats["spec_draft_tokens_per_step"] == pytest.approx(c.draft_tokens / c.drafted_steps)
    assert stats["spec_tokens_per_step"] == pytest.approx(1 + c.accepted_draft_tokens / c.drafted_steps)
    assert 0 < stats["spec_acceptance_rate"] < 1
    snapshots = WorkerSnapshots()
    snapshots.update(WorkerStats("decode", "w0", snapshot))
    exported = {m.name: m.samples[0].value for m in snapshots.collect() if m.samples}
    for key in ("spec_acceptance_rate", "spec_draft_tokens_per_step", "spec_tokens_per_step", "drafted_steps"):
        assert exported[f"kvmesh_worker_{key}"] == pytest.approx(stats[key])
