"""AsyncEngine: one streamed output per token, concurrent streams equal the sync engine,
errors surface on the stream, and abort frees everything."""
from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from tests.helpers import random_prompt, write_tiny_checkpoint
from kvmesh.workers.engine import Engine
from kvmesh.workers.engine.async_engine import AsyncEngine
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.sampling.params import InvalidRequestError, SamplingParams

NAME, BLOCK = "swa_csa_hca", 16
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [random_prompt(n, seed=n) for n in (3, 20, 41, 70)]


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> EngineConfig:
    path = write_tiny_checkpoint(tmp_path_factory.mktemp(NAME), NAME)
    return EngineConfig(model=str(path), block_tokens=BLOCK, kv_cache_bytes=8 << 20)


@pytest.fixture(scope="module")
def expected(config) -> list[list[int]]:
    return [o.token_ids for o in Engine(config).generate(PROMPTS, GREEDY)]


@pytest.fixture
def aengine(config):
    engine = AsyncEngine(config)
    yield engine
    engine.shutdown()


async def collect(engine: AsyncEngine, rid: str, prompt, params=GREEDY):
    return [out async for out in engine.generate(rid, prompt, params)]


async def idle(engine: AsyncEngine, timeout: float = 10.0) -> bool:
    """True once the engine has no unfinished work and every block and slot is free."""
    e = engine.engine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = await asyncio.wrap_future(engine.call(
            lambda: not e.has_unfinished() and e.blocks.num_free == e.blocks.num_blocks
            and e.slots.num_free == e.slots.num_slots and not e.seqs))
        if done:
            return True
        await asyncio.sleep(0.02)
    return False


def test_stream_yields_one_output_per_token_and_ends_finished(aengine, expected):
    outs = asyncio.run(collect(aengine, "one", PROMPTS[1]))
    assert len(outs) == GREEDY.max_tokens
    assert all(len(o.new_token_ids) == 1 for o in outs)
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert outs[-1].finish_reason == "length"
    assert [o.new_token_ids[0] for o in outs] == outs[-1].token_ids == expected[1]
    assert [len(o.token_ids) for o in outs] == list(range(1, len(outs) + 1))


def test_concurrent_streams_each_equal_the_sync_engine(aengine, expected):
    async def main():
        return await asyncio.gather(*(collect(aengine, f"c{i}", p) for i, p in enumerate(PROMPTS)))
    results = asyncio.run(main())
    assert [r[-1].token_ids for r in results] == expected
    assert all(r[-1].finished and r[-1].request_id == f"c{i}" for i, r in enumerate(results))


def test_invalid_request_raises_from_the_stream(aengine):
    async def main():
        with pytest.raises(InvalidRequestError, match="max_tokens"):
            await collect(aengine, "bad-params", PROMPTS[0], SamplingParams(max_tokens=0))
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            await collect(aengine, "bad-prompt", [5, 10 ** 6])
        return await idle(aengine)
    assert asyncio.run(main())


def test_duplicate_request_id_is_refused_and_the_first_stream_still_completes(aengine, expected):
    async def main():
        first = aengine.generate("dup", PROMPTS[2], GREEDY)
        head = await first.__anext__()
        with pytest.raises(InvalidRequestError, match="dup"):
            await collect(aengine, "dup", PROMPTS[3])
        rest = await asyncio.wait_for(collect_rest(first), timeout=30)
        return [head] + rest
    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].token_ids == expected[2]


async def collect_rest(stream):
    return [o async for o in stream]


def test_abort_mid_stream_frees_the_request(aengine):
    async def main():
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        async with contextlib.aclosing(aengine.generate("long", PROMPTS[3], long)) as stream:
            async for out in stream:
                if len(out.token_ids) == 2:
                    break
        return out, await idle(aengine)
    last, freed = asyncio.run(main())
    assert not last.finished
    assert freed
    assert aengine.engine.counters.generated_tokens < 200
