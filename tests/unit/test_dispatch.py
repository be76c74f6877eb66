"""The dispatcher (cluster/serve/dispatch.py): its retry rules, over pools whose decode replica
dies (RayActorError, what Ray raises for a killed replica) on the first attempt: an n > 1 request
is retried like any other until its first tokens are sent, under a fresh request id, continuing
after the tokens already sent; and the time budget a prefill gets."""
from __future__ import annotations

import asyncio

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
