"""Redis faults on the test's own redis-server (error replies, not just outages): OOM
under `noeviction`, READONLY after a REPLICAOF, a server stalled by DEBUG SLEEP. Every
request completes with the cold run's tokens, and no log line ever shows the password
in the index URL."""
from __future__ import annotations

import contextlib
import logging
import threading
import time

import pytest

from tests.conftest import REDIS_PASSWORD as PASSWORD
from tests.helpers import random_prompt, write_tiny_checkpoint
from tests.local_serve import free_port
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
