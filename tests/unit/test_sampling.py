"""Sampling parameters through the whole engine: greedy equivalences, seeds, stops, EOS,
min_tokens, logprobs, and validation that names the offending field."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import random_prompt, reference_model, tiny_engine, write_tiny_checkpoint
from kvmesh.workers.engine import Engine
from kvmesh.workers.sampling.params import InvalidRequestError, SamplingParams
from kvmesh.workers.sampling.sampler import sample

NAME, BLOCK = "swa_csa_hca", 16
PROMPT = random_prompt(23, seed=3)
N = 8
GREEDY = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp(NAME), NAME)


@pytest.fixture(scope="module")
def engine(checkpoint) -> Engine:
    return tiny_engine(checkpoint, NAME)


@pytest.fixture(scope="module")
def greedy(engine) -> list[int]:
    return engine.generate([PROMPT], GREEDY)[0].token_ids


def run(engine: Engine, **kw):
    return engine.generate([PROMPT], SamplingParams(**kw))[0]


def with_eos(checkpoint: Path, tmp_path: Path, eos: int) -> Engine:
    """The same weights under a config whose eos_token_id is `eos`."""
    path = tmp_path / "eos"
    path.mkdir()
    (path / "model.safetensors").symlink_to(checkpoint / "model.safetensors")
    config = json.loads((checkpoint / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    return tiny_engine(path, NAME)


def first_repeat_free_index(tokens: list[int]) -> int:
    """An index i > 0 whose token does not occur before it (so stopping on it stops at i)."""
    return next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])


def test_greedy_equals_temperature_zero_equals_top_k_one(engine, greedy):
    assert len(greedy) == N
    assert run(engine, max_tokens=N, temperature=1.0, top_k=1, seed=7, ignore_eos=True).token_ids == greedy
    assert run(engine, max_tokens=N, temperature=0.5, top_k=1, ignore_eos=True).token_ids == greedy


def test_tiny_top_p_is_argmax(engine, greedy):
    assert run(engine, max_tokens=N, temperature=1.0, top_p=1e-6, seed=3, ignore_eos=True).token_ids == greedy


def test_same_seed_same_tokens_different_seed_different_tokens(engine):
    sampled = dict(max_tokens=N, temperature=1.0, ignore_eos=True)
    a = run(engine, seed=1234, **sampled).token_ids
    b = run(engine, seed=1234, **sampled).token_ids
    c = run(engine, seed=4321, **sampled).token_ids
    assert a == b
    assert a != c  # 8 draws from a 300-token, near-flat distribution: a collision is ~impossible


def test_seeded_request_is_unaffected_by_its_batch_neighbours(engine):
    params = SamplingParams(max_tokens=N, temperature=1.0, seed=99, ignore_eos=True)
    alone = engine.generate([PROMPT], params)[0].token_ids
    others = SamplingParams(max_tokens=N, temperature=1.0, ignore_eos=True)
    batched = engine.generate([random_prompt(40, seed=1), PROMPT, random_prompt(9, seed=2)],
                              [others, params, others])[1].token_ids
    assert batched == alone


def test_max_tokens_is_honoured_with_finish_reason_length(engine):
    for n in (1, 5):
        out = run(engine, max_tokens=n, temperature=0.0, ignore_eos=True)
        assert len(out.token_ids) == n and out.finish_reason == "length" and out.finished


def test_stop_token_ids_stop_with_reason_stop(engine, greedy):
    i = first_repeat_free_index(greedy)
    out = run(engine, max_tokens=N, temperature=0.0, stop_token_ids=(greedy[i],), ignore_eos=True)
    assert out.token_ids == greedy[:i + 1]
    assert out.finish_reason == "stop"


def test_eos_stops_generation_unless_ignore_eos(checkpoint, tmp_path, greedy):
    i = first_repeat_free_index(greedy)
    engine = with_eos(checkpoint, tmp_path, eos=greedy[i])
    kept_going = run(engine, max_tokens=N, temperature=0.0, ignore_eos=True)
    assert kept_going.token_ids == greedy and kept_going.finish_reason == "length"
    assert greedy[i] in kept_going.token_ids[:-1]       # EOS was produced and generation went on
    stopped = run(engine, max_tokens=N, temperature=0.0)
    assert stopped.token_ids == greedy[:i + 1] and stopped.finish_reason == "stop"


def test_min_tokens_suppresses_stop_token_ids(engine, greedy):
    stop = greedy[0]
    assert run(engine, max_tokens=N, temperature=0.0, stop_token_ids=(stop,)).token_ids == [stop]
    out = run(engine, max_tokens=N, temperature=0.0, stop_token_ids=(stop,), min_tokens=3)
    assert len(out.token_ids) >= 3 and stop not in out.token_ids[:3]


def test_min_tokens_suppresses_eos(checkpoint, tmp_path, greedy):
    engine = with_eos(checkpoint, tmp_path, eos=greedy[0])
    stopped = run(engine, max_tokens=N, temperature=0.0)
    assert stopped.token_ids == [greedy[0]] and stopped.finish_reason == "stop"
    out = run(engine, max_tokens=N, temperature=0.0, min_tokens=3)
    assert len(out.token_ids) >= 3 and greedy[0] not in out.token_ids[:3]


def test_greedy_logprobs_are_log_softmax_of_the_model_logits(checkpoint, engine, greedy):
    out = engine.generate([PROMPT], GREEDY)[0]
    ref = reference_model(str(checkpoint))
    with torch.no_grad():
        logits = ref(torch.tensor([PROMPT + greedy])).logits[0].float()
    expected = torch.log_softmax(logits, -1)[len(PROMPT) - 1:-1].gather(1, torch.tensor(greedy)[:, None])[:, 0]
    assert all(lp <= 0 for lp in out.logprobs)
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=2e-4)


def test_sampled_logprobs_are_under_the_unmodified_distribution():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    full = torch.log_softmax(logits, -1)
    for params in (SamplingParams(temperature=0.7, top_k=5, seed=1), SamplingParams(temperature=1.3, top_p=0.5, seed=2),
                   SamplingParams(temperature=0.0)):
        g = torch.Generator().manual_seed(params.seed or 0)
        for _ in range(10):
            token, lp = sample(logits, params, g)
            assert lp <= 0 and lp == pytest.approx(float(full[token]), abs=1e-6)


def test_sampler_respects_top_k_top_p_and_banned_tokens():
    logits = torch.tensor([5.0, 4.0, 3.0, 0.0, -1.0])
    g = torch.Generator().manual_seed(0)
    drawn = {sample(logits, SamplingParams(temperature=5.0, top_k=2), g)[0] for _ in range(200)}
    assert drawn == {0, 1}
    drawn = {sample(logits, SamplingParams(temperature=1.0, top_p=0.8), g)[0] for _ in range(200)}
    assert drawn <= {0, 1} and 0 in drawn
    assert sample(logits, SamplingParams(temperature=0.0), None, banned=(0,))[0] == 1
    assert all(sample(logits, SamplingParams(temperature=1.0), g, banned=(0, 1))[0] not in (0, 1) for _ in range(50))


INVALID = [
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=-3)),
    ("max_tokens", dict(max_tokens=2.5)),
    ("temperature", dict(temperature=-0.1)),
    ("temperature", dict(temperature=float("nan"))),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("top_k", dict(top_k=-1)),
    ("seed", dict(seed="42")),
    ("seed", dict(seed=1.5)),
    ("seed", dict(seed=2 ** 64)),
    ("min_tokens", dict(min_tokens=5, max_tokens=4)),
    ("min_tokens", dict(min_tokens=-1)),
    ("stop_token_ids", dict(stop_token_ids=("a",))),
    ("ignore_eos", dict(ignore_eos="no")),
]


@pytest.mark.parametrize("field,kw", INVALID, ids=[f"{f}={list(kw.values())[0]!r}" for f, kw in INVALID])
def test_invalid_sampling_values_raise_naming_the_field(engine, field, kw):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kw).validate()
    with pytest.raises(InvalidRequestError, match=field):
        engine.add_request(f"bad-{field}", PROMPT, SamplingParams(**kw))
    assert not engine.has_unfinished()
