"""Guided decoding with one packed bitmask per step (issue 49): the sampler fills one int32
[B, ceil(V/32)] mask for all guided rows and applies it with xgrammar's batched in-place op.
Checked against the path it replaced (each guided row's bool [V] mask unpacked on the host and
applied row by row): the same processed logits and greedy tokens for a batch of guided and
unguided rows with penalties, logit_bias and bans, on a vocabulary that is not a multiple of 32
(and logits padded past it); guided output with speculative drafts (each drawn row masked as
it is drawn) equal to guided output without."""
from __future__ import annotations

import json
import random

import pytest
import torch

from tests.helpers import random_prompt, tiny_engine, write_tiny_checkpoint
from kvmesh.workers.checkpoint.tokenizer import BYTE_OFFSET
from kvmesh.workers.sampling.grammar import GuideCompiler
from kvmesh.workers.sampling.params import SamplingParams
from kvmesh.workers.sampling.sampler import SampleRow, processed, sample_batch
from kvmesh.workers.spec.speculative import OracleDrafter

VOCAB = 300                 # the byte tokenizer's 259 ids, then ids no text maps to; 300 % 32 = 12
EOS = 1
SCHEMA = json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
                     "required": ["ok", "n"], "additionalProperties": False})
BOUNDED = json.dumps({"type": "object", "properties": {
    "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3}},
    "required": ["ok", "n", "tags"], "additionalProperties": False})    # a bounded output: ends well inside max_tokens
LIST = json.dumps({"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 4})


def ids(text: str) -> list[int]:
    return [b + BYTE_OFFSET for b in text.encode()]


@pytest.fixture(scope="module")
def compiler():
    c = GuideCompiler(None, VOCAB, [EOS])
    yield c
    c.close()


def old_allowed(guide) -> torch.Tensor:
    """The replaced Guide.allowed(): a one-row bitmask unpacked to bool [V] on the host."""
    import xgrammar as xgr
    mask = xgr.allocate_token_bitmask(1, guide.vocab_size)
    guide.matcher.fill_next_token_bitmask(mask, 0)
    bits = (mask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.bool().reshape(-1)[:guide.vocab_size]


def old_processed(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """The replaced path: penalties, logit_bias and bans as before, then each guided row's bool
    mask copied and applied by itself (`work[i].masked_fill_(~allowed, -inf)`)."""
    plain = [SampleRow(r.params, r.generator, r.banned, r.prompt, r.output) for r in rows]
    work = processed(logits, plain)
    for i, r in enumerate(rows):
        if r.guide is not None:
            work[i].masked_fill_(~old_allowed(r.guide), float("-inf"))
    return work


def mixed_rows(compiler) -> list[SampleRow]:
    """Eight rows: guided ones at various points of two schemas and JSON mode, unguided ones;
    penalties, logit_bias and a min_tokens ban on some of each."""
    def guide(kind: str, schema: str, prefix: str):
        g = compiler.guide((kind, schema))
        for t in ids(prefix):
            g.accept(t)
        return g
    biased = SamplingParams(temperature=0.0, logit_bias=((ord("{") + BYTE_OFFSET, 50.0), (ord("t") + BYTE_OFFSET, 7.0)))
    penal = SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)
    greedy, hot = SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1)
    return [
        SampleRow(greedy, guide=guide("json_schema", SCHEMA, "")),
        SampleRow(biased),
        SampleRow(biased, guide=guide("json_schema", SCHEMA, '{"ok":')),
        SampleRow(penal, prompt=ids("abc{"), output=ids('{"n":1'), guide=guide("json_schema", SCHEMA, '{"n":1')),
        SampleRow(greedy, banned=(EOS, 5)),
        SampleRow(greedy, banned=(EOS,), guide=guide("json_schema", LIST, '["a","bb"')),
        SampleRow(hot, torch.Generator().manual_seed(3), guide=guide("json_object", "", "{")),
        SampleRow(penal, prompt=ids("xyz"), output=ids("zz")),
    ]


def test_one_bitmask_for_the_batch_equals_the_per_row_bool_masks(compiler):
    rows = mixed_rows(compiler)
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(7)) * 4
    want = old_processed(logits, rows)
    got = processed(logits, rows)
    assert torch.equal(got, want)
    assert got.isinf().any(dim=1).tolist() == [True, False, True, True, True, True, True, False]
    greedy = [i for i, r in enumerate(rows) if r.params.temperature == 0.0]
    tokens = sample_batch(logits, rows).tokens
    assert [tokens[i] for i in greedy] == want[greedy].argmax(dim=1).tolist()


def test_every_row_guided_and_logits_wider_than_the_vocabulary(compiler):
    """All rows guided (no indices) and logits padded past the vocabulary: the padding columns
    are refused in guided rows, untouched in the others."""
    rows = [r for r in mixed_rows(compiler) if r.guide is not None]
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(8))
    assert torch.equal(processed(logits, rows), old_processed(logits, rows))

    rows = mixed_rows(compiler)
    padded = torch.randn(len(rows), VOCAB + 13, generator=torch.Generator().manual_seed(9))
    got = processed(padded, rows)
    assert torch.equal(got[:, :VOCAB], old_processed(padded[:, :VOCAB].contiguous(), rows))
    guided = torch.tensor([r.guide is not None for r in rows])
    assert got[guided, VOCAB:].isneginf().all()
    assert torch.equal(got[~guided, VOCAB:], padded[~guided, VOCAB:])


# ---- the engine: speculative steps of guided requests ----------------------------------------
NAME = "swa_csa_hca"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp(NAME), NAME)


def corrupt(tokens: list[int], rate: float, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [(t + 1) % 300 if rng.random() < rate else t for t in tokens]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=80, temperature=0.0),
                                    SamplingParams(max_tokens=80, temperature=0.9, top_k=50, seed=5)],
                         ids=["greedy", "seeded"])
def test_guided_output_with_drafts_equals_guided_output_without(checkpoint, params):
    """Right, wrong (often refused by the grammar) and ending drafts give the tokens of plain
    decoding: each drawn row is masked by the grammar's state after the tokens before it."""
    guided = SamplingParams(**{**params.__dict__, "guide": ("json_schema", BOUNDED)})
    prompts = [random_prompt(n, seed=40 + n) for n in (5, 13, 22)]
    plain = tiny_engine(checkpoint, NAME)
    outs = plain.generate(prompts, guided)
    assert all(o.finish_reason == "stop" and json.loads(o.text) for o in outs)
    want = [o.token_ids for o in outs]
    engine = tiny_engine(checkpoint, NAME)
    engine.set_drafter(OracleDrafter({tuple(p): corrupt(w, 0.25, seed=2) for p, w in zip(prompts, want)}), 3)
    assert [o.token_ids for o in engine.generate(prompts, guided)] == want
    s = engine.counters
    assert 0 < s.accepted_draft_tokens < s.draft_tokens
