"""A replica's serving slots and the wait for a grammar outside them (issue 48 item 1): guided
requests whose grammar compiles hold no slot while a plain request takes one; past its client's
bound, or the replica's, a request gets TooManyRequests at once (a 429) and waits for nothing; a
refused grammar never takes a slot, and sent again it is refused at once. Real xgrammar in real
compiler processes (tests/unit/test_compile_pool.py's byte tokenizer), asserted on the gate's
state, not on time."""
from __future__ import annotations

import asyncio

import pytest

from kvmesh.cluster.errors import TooManyRequests
from kvmesh.cluster.messages import GenRequest
from kvmesh.cluster.serve.grammar_gate import GrammarGate
from kvmesh.workers.sampling.params import InvalidRequestError, SamplingParams
from tests.unit.test_compile_pool import BUDGET_S, SMALL, byte_compiler, wide


def request(client: str, schema: str | None) -> GenRequest:
    guide = ("json_schema", schema) if schema is not None else None
    return GenRequest(f"{client}-{id(schema)}", [1, 2, 3], SamplingParams(guide=guide), client)


async def served(gate: GrammarGate, req: GenRequest, inside: list, release: asyncio.Event) -> str:
    """Admit `req`, note the gate's state once it holds a slot, and hold it until `release`."""
    async with gate.admitted(req):
        inside.append((req.client, gate.serving, gate.grammar_waiting))
        await release.wait()
    return "served"


async def until(check, timeout_s: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def compiler():
    """One compiler (its two processes) for the module: each test's schemas are its own."""
    c = byte_compiler(compile_timeout_s=BUDGET_S, compile_workers=2, compile_memory_bytes=8 << 30)
    yield c
    c.close()


def test_grammar_waits_hold_no_slot_and_each_client_is_bounded(compiler):
    gate = GrammarGate(compiler, slots=1, waiting=3, per_client=2, retry_after_s=3)

    async def scenario():
        inside: list = []
        go = asyncio.Event()
        slow = [asyncio.create_task(served(gate, request("A", wide(1000 + i)), inside, go)) for i in range(2)]
        await until(lambda: gate.waiting["A"] == 2)
        assert gate.serving == 0                                    # compiling: no slot held
        with pytest.raises(TooManyRequests, match="grammar_waiting_per_client: 2") as busy:
            async with gate.admitted(request("A", wide(1002))):
                pass
        assert busy.value.retry_after_s == 3 and gate.refused == 1 and gate.waiting["A"] == 2
        assert compiler.stats().queued + compiler.stats().running == 2      # the refused one started no compile
        plain = asyncio.create_task(served(gate, request("B", None), inside, go))
        await until(lambda: inside)
        assert inside[0] == ("B", 1, 2)                             # the one slot, beside two compiles
        other = asyncio.create_task(served(gate, request("C", wide(1003)), inside, go))
        await until(lambda: gate.grammar_waiting == 3)
        with pytest.raises(TooManyRequests, match="max_grammar_waiting: 3"):
            async with gate.admitted(request("D", wide(1004))):
                pass
        go.set()
        assert await plain == "served"
        for task in (*slow, other):     # each ends at its budget: a 400, never a slot
            with pytest.raises(InvalidRequestError, match="time budget"):
                await task
        assert [c for c, *_ in inside] == ["B"] and gate.serving == 0 and gate.grammar_waiting == 0
        kills = compiler.stats().budget_kills
        with pytest.raises(InvalidRequestError, match="time budget"):     # remembered: no wait, no compile
            async with gate.admitted(request("A", wide(1000))):
                pass
        assert compiler.stats().budget_kills == kills and gate.grammar_waiting == 0
        inside.clear()
        small = asyncio.create_task(served(gate, request("A", SMALL), inside, go))
        assert await small == "served" and inside == [("A", 1, 0)]

    asyncio.run(scenario())


def test_a_client_that_leaves_stops_waiting_and_the_compile_goes_on(compiler):
    gate = GrammarGate(compiler, slots=1, waiting=4, per_client=4, retry_after_s=1)

    async def scenario():
        # the last test's budget-killed compile counts as running until its child has restarted
        await until(lambda: compiler.stats().running + compiler.stats().queued == 0)
        kills = compiler.stats().budget_kills
        waiter = asyncio.create_task(served(gate, request("A", wide(1100)), [], asyncio.Event()))
        await until(lambda: gate.grammar_waiting == 1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert gate.grammar_waiting == 0 and gate.serving == 0
        assert compiler.stats().running + compiler.stats().queued == 1     # shared: it goes on for the cache
        await until(lambda: compiler.stats().budget_kills == kills + 1)     # ... to its end (its budget)

    asyncio.run(scenario())
