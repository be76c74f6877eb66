"""The restore planner on its own: what each SWA policy loads and recomputes."""
import pytest

from kvmesh.kvstore.policy.planner import MISS, Availability, PolicyError, SwaPolicy, plan_restore, recompute_span

BT = 16
FULL, ZERO, PERIODIC = SwaPolicy("full"), SwaPolicy("zero"), SwaPolicy("periodic", 32)


def avail(blocks, checkpoints=()):
    return Availability(blocks, frozenset(checkpoints))


def test_policy_parse_accepts_the_three_policies_and_rejects_bad_periods():
    assert SwaPolicy.parse("full", BT) == FULL
    assert SwaPolicy.parse("periodic:32", BT) == PERIODIC
    assert SwaPolicy.parse("zero", BT) == ZERO
    for bad in ("periodic:10", "periodic:x", "periodic:0", "half"):
        with pytest.raises(PolicyError):
            SwaPolicy.parse(bad, BT)


def test_nothing_available_is_a_miss_for_every_policy():
    for policy in (FULL, ZERO, PERIODIC):
        assert plan_restore(100, BT, avail(0), policy, 20) == MISS


def test_full_restores_every_available_block_but_never_the_last_prompt_token():
    assert plan_restore(100, BT, avail(3), FULL, 0).hit_tokens == 48
    assert plan_restore(64, BT, avail(4), FULL, 0).hit_tokens == 48     # aligned prompt: last block recomputed
    assert plan_restore(65, BT, avail(4), FULL, 0).hit_tokens == 64     # one token past a boundary
    plan = plan_restore(100, BT, avail(6), FULL, 0)
    assert (plan.load_blocks, plan.recompute_from, plan.keep_tokens, plan.checkpoint) == (6, 96, 96, None)


def test_periodic_restores_at_the_nearest_checkpoint_at_or_before_the_hit():
    plan = plan_restore(200, BT, avail(7, {1, 3, 5}), PERIODIC, 0)
    assert (plan.checkpoint, plan.load_blocks, plan.hit_tokens, plan.recompute_from) == (5, 6, 96, 96)
    assert plan_restore(200, BT, avail(4, {1, 3, 5}), PERIODIC, 0).hit_tokens == 64
    assert plan_restore(200, BT, avail(4, set()), PERIODIC, 0) == MISS


def test_zero_recomputes_the_span_before_the_hit_with_loaded_entries_kept():
    plan = plan_restore(200, BT, avail(10), ZERO, span=30)
    assert plan.load_blocks == 10 and plan.keep_tokens == 160
    assert plan.recompute_from == 128 and plan.hit_tokens == 128 and plan.recompute_tokens == 32
    assert plan_restore(200, BT, avail(2), ZERO, span=30) == MISS      # span reaches token 0: nothing saved


def test_recompute_span_covers_every_layer_and_the_overlap_window():
    assert recompute_span(num_layers=3, window=8, max_ratio=4) == 21
    assert recompute_span(num_layers=3, window=8, max_ratio=128) == 128 + 14
