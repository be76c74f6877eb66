"""The dispatcher (cluster/serve/dispatch.py): its retry rules, over pools whose decode replica
dies (RayActorError, what Ray raises for a killed replica) on the first attempt: an n > 1 request
is retried like any other until its first tokens are sent, under a fresh request id, continuing
after the tokens already sent; the time budget a prefill gets; and what a request whose client
leaves releases, between prefill's answer and decode's first chunk (issue 48 item 3)."""
from __future__ import annotations

import asyncio
from contextlib import suppress
from types import SimpleNamespace

import pytest
from ray.exceptions import RayActorError

from kvmesh.cluster.errors import WorkerFailed
from kvmesh.cluster.serve.dispatch import Dispatcher, continuation, prefill_budget_s
from kvmesh.cluster.messages import Chunk, GenRequest, Handoff
from kvmesh.cluster.serve.metrics import Metrics
from kvmesh.workers.request import FirstToken
from kvmesh.workers.sampling.params import InvalidRequestError, SamplingParams


class Stream:
    """What a Serve streaming call returns: an async iterator that can be cancelled."""

    def __init__(self, chunks, fail_after: int | None):
        self.chunks, self.fail_after, self.sent = list(chunks), fail_after, 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.sent == self.fail_after:
            raise RayActorError()
        if self.sent == len(self.chunks):
            raise StopAsyncIteration
        self.sent += 1
        return self.chunks[self.sent - 1]

    def cancel(self) -> None:
        pass


class Pools:
    """Prefill answers with a handoff of n first tokens; decode fails on the first call after
    `fail_after` chunks, then streams the rest."""

    def __init__(self, n: int, fail_after: int):
        self.n, self.fail_after, self.prefilled, self.decoded = n, fail_after, [], 0
        self.prefill, self.decode = self, self

    def options(self, stream: bool):
        return self

    def remote(self, req: GenRequest, handoff: Handoff | None = None, hint=None):
        if handoff is None:
            self.prefilled.append(req.request_id)
            return self._handoff(req)
        self.decoded += 1
        chunks = [Chunk([20 + i], [0.0], True, "length", 3, 0, index=i, all_finished=i == self.n - 1)
                  for i in range(self.n)]
        return Stream(chunks, self.fail_after if self.decoded == 1 else None)

    async def _handoff(self, req: GenRequest) -> Handoff:
        """Token k of sequence i is 10 * k + i (a continuation's prompt holds the tokens sent)."""
        first, done = 10 * (len(req.prompt) - 2), req.params.max_tokens == 1
        ended = "length" if done else None
        siblings = tuple(FirstToken(first + i, 0.0, (), ended, i) for i in range(1, self.n))
        return Handoff(req.request_id, len(req.prompt), FirstToken(first, 0.0, (), ended), done, ended, 0, "p0",
                       offer=None if done else object(), siblings=siblings)


def run(pools: Pools, n: int) -> tuple[list[tuple[int, int]], Metrics]:
    metrics = Metrics()
    dispatch = Dispatcher("disaggregated", {"prefill": pools, "decode": pools}, metrics, 5.0, 2)
    req = GenRequest("r", [1, 2, 3], SamplingParams(max_tokens=2, n=n, temperature=1.0, seed=1))

    async def collect():
        return [(c.index, t) async for c in dispatch.stream(req) for t in c.token_ids]
    return asyncio.run(collect()), metrics


def retries(metrics: Metrics) -> float:
    return metrics.registry.get_sample_value("kvmesh_retries_total") or 0.0


def test_an_n_gt_1_request_whose_decode_dies_before_its_first_chunk_is_retried():
    pools = Pools(n=2, fail_after=0)
    tokens, metrics = run(pools, n=2)
    assert sorted(tokens) == [(0, 10), (0, 20), (1, 11), (1, 21)]     # each first token sent once
    assert retries(metrics) == 1
    assert len(pools.prefilled) == 2 and pools.prefilled[0] != pools.prefilled[1]   # a fresh id


def test_an_n_gt_1_request_that_already_sent_tokens_ends_with_a_clean_error():
    with pytest.raises(WorkerFailed):
        run(Pools(n=2, fail_after=1), n=2)


def test_a_single_sequence_request_still_resumes_as_a_continuation():
    pools = Pools(n=1, fail_after=0)
    tokens, metrics = run(pools, n=1)
    assert tokens == [(0, 10), (0, 20)] and retries(metrics) == 1
    assert pools.prefilled == ["r", "r-r1"]


def test_a_request_refused_for_its_own_content_is_never_retried():
    """A 400 from a worker (here the compile budget of a schema) is the request's fault: re-running
    it would only repeat the work (the issue's schema was compiled twice)."""
    class Refusing(Pools):
        def remote(self, req, handoff=None, hint=None):
            self.prefilled.append(req.request_id)

            async def refuse():
                raise InvalidRequestError("compiling the JSON schema exceeded its time budget", "response_format")
            return refuse()
    pools = Refusing(n=1, fail_after=0)
    with pytest.raises(InvalidRequestError, match="response_format"):
        run(pools, n=1)
    assert pools.prefilled == ["r"]


def test_retry_continues_after_the_tokens_already_sent():
    req = GenRequest("r", [1, 2, 3], SamplingParams(max_tokens=10, min_tokens=4))
    assert continuation(req, []) is req
    cont = continuation(req, [7, 8, 9])
    assert cont.prompt == [1, 2, 3, 7, 8, 9] and cont.params.max_tokens == 7 and cont.params.min_tokens == 1
    assert cont.request_id != req.request_id


def test_prefill_budget_grows_with_the_prompt():
    assert prefill_budget_s(60_000, 60, 10) == 660


# ---- a client that leaves between prefill's answer and decode's first chunk -------------------------

NIXL_OFFER = SimpleNamespace(transport="nixl")      # prefill holds the cache until decode reads it


class Reply:
    """What a unary Serve call returns: awaitable (again after a cancel, as a DeploymentResponse
    is), cancellable; it answers once `gate` is set."""

    def __init__(self, value, gate: asyncio.Event | None = None):
        self.value, self.gate, self.cancelled = value, gate, False

    def cancel(self) -> None:
        self.cancelled = True

    def __await__(self):
        return self._get().__await__()

    async def _get(self):
        if self.gate is not None:
            await self.gate.wait()
        return self.value


class DecodeCall:
    """A streaming Serve call whose chunks come once `gate` is set; when it was cancelled (after
    how many chunks) is recorded."""

    def __init__(self, chunks: list[Chunk], gate: asyncio.Event):
        self.chunks, self.gate, self.sent, self.cancelled_after = chunks, gate, 0, None

    def __aiter__(self):
        return self

    async def __anext__(self):
        await self.gate.wait()
        if self.sent == len(self.chunks):
            raise StopAsyncIteration
        self.sent += 1
        return self.chunks[self.sent - 1]

    def cancel(self) -> None:
        if self.cancelled_after is None:
            self.cancelled_after = self.sent


class Method:
    def __init__(self, fn):
        self.remote = fn


class HoldingPools:
    """Prefill worker "p0" answers with a handoff whose cache it holds (a NIXL offer) once
    `prefill_gate` is set, and records the releases it is asked for (request id, pinned worker);
    decode streams two chunks once `decode_gate` is set."""

    def __init__(self, prefill_gate: asyncio.Event | None = None):
        self.prefill_gate, self.decode_gate = prefill_gate, asyncio.Event()
        self.replies: list[Reply] = []
        self.calls: list[DecodeCall] = []
        self.released: list[tuple[str, str]] = []
        self.prefill, self.decode, self.release = Method(self._prefill), Method(self._decode), Method(self._release)

    def options(self, stream: bool):
        return self

    def _prefill(self, req: GenRequest, hint=None) -> Reply:
        handoff = Handoff(req.request_id, len(req.prompt), FirstToken(7, 0.0, ()), False, None, 0, "p0",
                          offer=NIXL_OFFER)
        self.replies.append(Reply(handoff, self.prefill_gate))
        return self.replies[-1]

    def _decode(self, req: GenRequest, handoff: Handoff, hint=None) -> DecodeCall:
        self.calls.append(DecodeCall([Chunk([8 + i], [0.0], i == 1, "length" if i else None, 3, 0,
                                            all_finished=i == 1) for i in range(2)], self.decode_gate))
        return self.calls[-1]

    async def _release(self, request_id: str, hint=None) -> None:
        self.released.append((request_id, hint.require_worker))


def dispatcher(pools: HoldingPools) -> Dispatcher:
    return Dispatcher("disaggregated", {"prefill": pools, "decode": pools}, Metrics(), 5.0, 1)


async def settle(d: Dispatcher) -> None:
    """Until the dispatcher's background work (releases, decode calls left to settle) is done."""
    for _ in range(100):
        await asyncio.sleep(0)
    await asyncio.gather(*list(d._background))


GREEDY = SamplingParams(max_tokens=3, temperature=0.0)


def test_a_request_closed_after_the_handoff_and_before_decode_releases_the_held_cache():
    """The stream is closed after prefill's first token (the client left, or a stop string
    matched): decode is never called, and the prefill worker holding the cache is asked, pinned
    to it, to release it now (not at release_timeout_s)."""
    async def scenario():
        pools = HoldingPools()
        d = dispatcher(pools)
        stream = d.stream(GenRequest("r", [1, 2, 3], GREEDY))
        first = await stream.__anext__()
        assert first.token_ids == [7] and pools.released == []
        await stream.aclose()
        await settle(d)
        return pools
    pools = asyncio.run(scenario())
    assert pools.released == [("r", "p0")]
    assert pools.calls == []


def test_a_decode_call_left_before_its_first_chunk_is_let_read_the_cache_then_cancelled():
    """The client leaves while decode's call is out (queued, or running without a chunk yet):
    the call owns the handoff, so the ingress neither frees the cache (decode may be reading it)
    nor cancels the call before its first chunk (a queued call would then never run and nothing
    would free the cache); at its first chunk (the READ is done, its notification frees prefill's
    copy) the call is cancelled."""
    async def scenario():
        pools = HoldingPools()
        d = dispatcher(pools)
        stream = d.stream(GenRequest("r", [1, 2, 3], GREEDY))
        await stream.__anext__()
        waiting = asyncio.create_task(stream.__anext__())       # decode's first chunk
        while not pools.calls:
            await asyncio.sleep(0)
        waiting.cancel()                                        # the client went away
        with suppress(asyncio.CancelledError):
            await waiting
        await stream.aclose()
        for _ in range(100):
            await asyncio.sleep(0)
        call = pools.calls[0]
        left = (call.cancelled_after, list(pools.released))
        pools.decode_gate.set()
        await settle(d)
        return left, call, pools
    (cancelled_before, released_before), call, pools = asyncio.run(scenario())
    assert cancelled_before is None and released_before == []
    assert call.cancelled_after == 1            # cancelled at its first chunk, not before
    assert pools.released == []                 # decode's READ frees prefill's copy


def test_a_prefill_call_whose_client_left_is_cancelled_and_its_answer_released():
    """The client leaves while the prompt runs (or waits for a replica): the prefill call is
    cancelled, and if it answers all the same (it finished as the cancel came), the cache it
    holds is released at once."""
    async def scenario():
        pools = HoldingPools(prefill_gate=asyncio.Event())
        d = dispatcher(pools)
        stream = d.stream(GenRequest("r", [1, 2, 3], GREEDY))
        waiting = asyncio.create_task(stream.__anext__())
        while not pools.replies:
            await asyncio.sleep(0)
        waiting.cancel()
        with suppress(asyncio.CancelledError):
            await waiting
        cancelled = pools.replies[0].cancelled
        pools.prefill_gate.set()                # it answers anyway, with a held cache
        await settle(d)
        return cancelled, pools
    cancelled, pools = asyncio.run(scenario())
    assert cancelled
    assert pools.released == [("r", "p0")] and pools.calls == []


def test_a_short_uncached_part_or_a_long_prefill_queue_keeps_a_prompt_off_the_prefill_pool(monkeypatch):
    """Conditional disaggregation's decision: the prompt's part no decode replica holds (per the
    prefix hint, in the hint's blocks) against direct_max_tokens; the prompts in flight to the
    prefill pool against direct_queue; else the prefill pool."""
    from kvmesh.cluster.messages import RouteHint
    from kvmesh.cluster.serve import dispatch as module
    pools = SimpleNamespace(app_name="app", deployment_name="Decode")
    d = Dispatcher("disaggregated", {"prefill": pools, "decode": pools}, Metrics(), 5.0, 1,
                   direct_max_tokens=4, direct_queue=2, block_tokens=lambda: 4)
    monkeypatch.setattr(module, "live_replica_ids", lambda app, name: ["d1"])
    assert d._prefill_route([1] * 4, RouteHint()) == "decode_short"
    assert d._prefill_route([1] * 5, RouteHint()) == "prefill_pool"
    held = RouteHint(prefix_blocks={"d1/dp0": 2, "p1": 5})       # decode d1 holds 8 tokens, prefill p1 more
    assert d._prefill_route([1] * 12, held) == "decode_short"
    assert d._prefill_route([1] * 13, held) == "prefill_pool"
    assert d._prefill_route([1] * 12, RouteHint(prefix_blocks={"p1": 5})) == "prefill_pool"    # only prefill holds it
    d.in_flight["prefill"] = 2
    assert d._prefill_route([1] * 100, RouteHint()) == "decode_queue"
    off = Dispatcher("disaggregated", {"prefill": pools, "decode": pools}, Metrics(), 5.0, 1)
    assert off._prefill_route([1], RouteHint()) == "prefill_pool"
