"""Redis faults on the test's own redis-server (error replies, not just outages): OOM
under `noeviction`, READONLY after a REPLICAOF, a server stalled by DEBUG SLEEP. Every
request completes with the cold run's tokens, and no log line ever shows the password
in the index URL. A server paused with SIGSTOP stalls no stream on the ingress's event loop."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
import uuid

import pytest

from tests.conftest import REDIS_PASSWORD as PASSWORD
from tests.helpers import random_prompt, write_tiny_checkpoint
from tests.local_serve import free_port
from kvmesh.cluster.messages import Chunk, GenRequest, RouteHint
from kvmesh.cluster.serve.dispatch import Dispatcher
from kvmesh.cluster.serve.locator import PrefixLocator
from kvmesh.cluster.serve.metrics import Metrics
from kvmesh.kvstore.hashing import PrefixHasher
from kvmesh.workers.engine import Engine
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.sampling.params import SamplingParams

BT = 16
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
PROMPT = random_prompt(120, seed=5)


@pytest.fixture(scope="module")
def server(password_redis):
    return password_redis


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("m"), "swa_csa_hca")


def engine(model_dir, store, url) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), block_tokens=BT, kv_cache_bytes=16 << 20,
                               store=str(store), index=url))


@pytest.fixture(scope="module")
def cold(model_dir):
    return Engine(EngineConfig(model=str(model_dir), block_tokens=BT, kv_cache_bytes=16 << 20)
                  ).generate([PROMPT], GREEDY)[0].token_ids


@contextlib.contextmanager
def out_of_memory(client):
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)
    try:
        yield
    finally:
        client.config_set("maxmemory", 0)


@contextlib.contextmanager
def read_only(client):
    client.execute_command("REPLICAOF", "127.0.0.1", free_port())   # a master that does not exist
    try:
        yield
    finally:
        client.execute_command("REPLICAOF", "NO", "ONE")


@contextlib.contextmanager
def stalled(client):
    t = threading.Thread(target=client.execute_command, args=("DEBUG", "SLEEP", 2.5))
    t.start()
    time.sleep(0.2)
    try:
        yield
    finally:
        t.join()


FAULTS = {"oom": out_of_memory, "readonly": read_only, "debug_sleep": stalled}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_redis_error_reply_or_stall_is_a_miss_and_outputs_stay_the_cold_runs(server, model_dir, cold, tmp_path,
                                                                               fault, caplog):
    client, url = server
    writer = engine(model_dir, tmp_path, url)
    assert writer.generate([PROMPT], GREEDY)[0].token_ids == cold
    writer.flush()
    with caplog.at_level(logging.DEBUG), FAULTS[fault](client):
        reader = engine(model_dir, tmp_path, url)            # start-up under the fault too
        outs = [reader.generate([PROMPT], GREEDY)[0] for _ in range(2)]
        reader.flush()
        reader.close()
    assert all(o.token_ids == cold for o in outs)
    assert reader.prefix.index.stats().errors >= 1
    assert PASSWORD not in caplog.text and ":***@" in caplog.text
    after = engine(model_dir, tmp_path, url).generate([PROMPT], GREEDY)[0]   # the fault is gone: reuse again
    assert after.token_ids == cold and after.cached_tokens > 0


def test_the_index_password_is_in_no_log_or_repr(server, model_dir, tmp_path, capfd, caplog):
    _, url = server
    dead = url.rsplit(":", 1)[0] + f":{free_port()}/0"        # same password, nobody listening
    with caplog.at_level(logging.DEBUG):
        e = engine(model_dir, tmp_path, dead)
        e.generate([PROMPT], GREEDY)
        e.close()
        logging.getLogger("test").warning("config: %r index: %r", e.config, e.prefix.index)
    text = caplog.text + "".join(capfd.readouterr())
    assert "unreachable" in text or "failed" in text
    assert PASSWORD not in text


class Colocated:
    """A colocated pool that sends one token each `gap_s`, `tokens` of them for request "running",
    three for any other; it records each call's hint."""

    def __init__(self, tokens: int, gap_s: float = 0.002):
        self.tokens, self.gap_s, self.hints = tokens, gap_s, {}
        self.generate = self

    def options(self, stream: bool):
        return self

    def remote(self, req: GenRequest, hint: RouteHint):
        self.hints[req.request_id] = hint
        return self._stream(req)

    async def _stream(self, req: GenRequest):
        tokens = self.tokens if req.request_id == "running" else 3
        for i in range(tokens):
            await asyncio.sleep(self.gap_s)
            last = i == tokens - 1
            yield Chunk([i], [0.0], last, "length" if last else None, len(req.prompt), 0)

    def cancel(self) -> None:
        pass


def test_a_paused_index_stalls_no_stream_on_the_ingress(server):
    """The ingress's fallback lookup (no KV events flowing) on a Redis stopped with SIGSTOP: the
    lookups wait on their own threads, the stream already running keeps receiving tokens while
    they are in flight, and the new requests are routed by load (an empty hint), not held."""
    client, url = server
    locator = PrefixLocator(url)
    locator.configure(uuid.uuid4().hex * 2, BT)
    dispatch = Dispatcher("colocated", {"colocated": (pool := Colocated(tokens=5000))}, Metrics(), 30.0, 0,
                          locator.hint_async, 0.0, locator.load_hint)
    prompt = random_prompt(4 * BT, seed=9)
    locator.index.publish_memory("w0", PrefixHasher(locator.index.fingerprint, BT).hashes(prompt)[:2], 30.0)
    pid = client.info("server")["process_id"]

    async def scenario():
        first = dispatch.stream(GenRequest("running", prompt, GREEDY))
        await first.__anext__()                           # its hint came from the index, Redis awake
        assert pool.hints["running"].prefix_blocks == {"w0": 2}
        os.kill(pid, signal.SIGSTOP)
        try:
            later = [asyncio.ensure_future(consume(dispatch.stream(GenRequest(f"new{i}", prompt, GREEDY))))
                     for i in range(4)]
            while locator.lookups_in_flight == 0 and not all(t.done() for t in later):
                await asyncio.sleep(0)
            during = 0                                    # the running stream's tokens while lookups wait on Redis
            while locator.lookups_in_flight > 0:
                await first.__anext__()
                during += 1
            sent = await asyncio.gather(*later)
        finally:
            os.kill(pid, signal.SIGCONT)
        await first.aclose()
        return during, sent

    try:
        during, sent = asyncio.run(scenario())
    finally:
        locator.close()
    assert during >= 10, during
    assert sent == [3] * 4
    assert all(pool.hints[f"new{i}"] == RouteHint() for i in range(4))     # routed by load
    assert locator.hints["index_slow"] + locator.hints["index_busy"] == 4
    assert locator.hints["index_busy"] == 2               # two lookup threads: the other two never waited


async def consume(stream) -> int:
    return sum([len(c.token_ids) async for c in stream])
