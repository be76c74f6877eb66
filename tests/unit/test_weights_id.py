"""Small parts of the reliability work, without Ray: the weights identity covers every
byte (and is cached), MAC'd objects, URL redaction, the incremental detokenizer, the
request body limit, metrics forgetting gone workers."""
from __future__ import annotations

import asyncio
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from cluster.errors import APIError
from cluster.openai.limits import read_body
from cluster.serve.dispatch import prefill_budget_s
from cluster.chat.detokenizer import Detokenizer
from kvstore.mac import StoreKey
from kvstore.objects import UnauthenticatedObjectError, decode_object, encode_object
from kvstore.redact import redact_url
from tests.helpers import write_tiny_checkpoint
from workers.checkpoint import weights_id
from workers.checkpoint.tokenizer import ByteTokenizer

FP = "0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("a"), "swa_csa_hca")


def test_checkpoints_differing_only_in_a_middle_tensor_get_different_identities(checkpoint, tmp_path):
    other = tmp_path / "b"
    shutil.copytree(checkpoint, other)
    (other / weights_id.CACHE_NAME).unlink(missing_ok=True)
    f = next(other.glob("*.safetensors"))
    tensors = load_file(f)
    names = sorted(tensors)
    middle = names[len(names) // 2]
    tensors[middle] = tensors[middle].clone()
    tensors[middle].view(-1)[tensors[middle].numel() // 2] += 1      # one value, mid-file; same size
    size = f.stat().st_size
    save_file(tensors, f, metadata={"format": "pt"})
    assert f.stat().st_size == size
    assert weights_id.weights_identity(checkpoint) != weights_id.weights_identity(other)


def test_the_identity_is_cached_by_size_and_mtime(checkpoint, monkeypatch):
    first = weights_id.weights_identity(checkpoint)
    assert (checkpoint / weights_id.CACHE_NAME).exists()

    def no_hashing(path):
        raise AssertionError("hashed again although nothing changed")
    monkeypatch.setattr(weights_id, "file_digest", no_hashing)
    assert weights_id.weights_identity(checkpoint) == first
    f = next(checkpoint.glob("*.safetensors"))
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 1))   # touched: hash again
    with pytest.raises(AssertionError):
        weights_id.weights_identity(checkpoint)


def test_a_read_only_checkpoint_caches_its_identity_in_the_user_cache(checkpoint, tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    shutil.copytree(checkpoint, ro)
    (ro / weights_id.CACHE_NAME).unlink(missing_ok=True)
    monkeypatch.setattr(weights_id.Path, "home", lambda: tmp_path / "home")
    real_write = weights_id._write_cache
    monkeypatch.setattr(weights_id, "_write_cache", lambda paths, files: real_write(
        [ro / "config.json" / "x.json"] + paths[1:], files))   # the checkpoint dir refuses
    ident = weights_id.weights_identity(ro)
    assert list((tmp_path / "home" / ".cache" / "kvmesh" / "weights-id").glob("*.json"))
    assert ident == weights_id.weights_identity(checkpoint)


def test_an_object_macd_with_one_key_is_rejected_under_another_and_without_a_mac():
    t = {"x": torch.arange(8, dtype=torch.float32)}
    a, b = StoreKey("k" * 16), StoreKey("j" * 16)
    good = encode_object(FP, "block", 7, None, 16, t, a)
    assert torch.equal(decode_object(bytearray(good), FP, 7, "block", key=a).tensors["x"], t["x"])
    assert torch.equal(decode_object(bytearray(good), FP, 7, "block").tensors["x"], t["x"])  # keyless: trusts
    with pytest.raises(UnauthenticatedObjectError):
        decode_object(bytearray(good), FP, 7, "block", key=b)
    with pytest.raises(UnauthenticatedObjectError):
        decode_object(bytearray(encode_object(FP, "block", 7, None, 16, t)), FP, 7, "block", key=a)
    assert "k" * 16 not in repr(a) and len(pytest.importorskip("kvstore.mac").StoreKey("z" * 16).mac([b""])) == 32
    with pytest.raises(ValueError):
        StoreKey("short")


def test_urls_lose_their_password_in_logs():
    assert redact_url("redis://:pw@h:6380/0") == "redis://:***@h:6380/0"
    assert redact_url("index rediss://user:p%40ss@h/1 down") == "index rediss://user:***@h/1 down"
    assert redact_url("redis://h:6380/0") == "redis://h:6380/0"


def test_the_detokenizer_decodes_a_bounded_window_per_token_and_still_matches_stops():
    tok, seen = ByteTokenizer(), []

    def decode(ids):
        seen.append(len(ids))
        return tok.decode(ids)
    ids = tok.encode("é" * 3000 + " the END here")
    d = Detokenizer(decode, ["END"])
    text = "".join(d.add([t]) for t in ids if not d.stopped) + d.finish()
    assert text == "é" * 3000 + " the " and d.stopped
    assert max(seen) <= 4          # each add decodes a few tokens, not the whole output


def test_body_limit_refuses_declared_and_streamed_bodies():
    class Req:
        def __init__(self, body, declared):
            self.headers = {"content-length": str(len(body))} if declared else {}
            self._body = body

        async def stream(self):
            for i in range(0, len(self._body), 10):
                yield self._body[i:i + 10]
    assert asyncio.run(read_body(Req(b"x" * 50, True), 50)) == b"x" * 50
    for declared in (True, False):
        with pytest.raises(APIError) as e:
            asyncio.run(read_body(Req(b"x" * 51, declared), 50))
        assert e.value.status == 413
    assert prefill_budget_s(60_000, 60, 10) == 660


def test_generate_exits_1_with_an_error_field_when_the_engine_fails(tmp_path, monkeypatch):
    import json

    from cluster.cli.generate import run_batch_file
    from workers.engine import Engine
    from workers.engine_config import EngineConfig
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "hi", "max_tokens": 2}\n')

    def broken_step(self):
        raise RuntimeError("simulated engine failure")
    monkeypatch.setattr(Engine, "step", broken_step)
    code = run_batch_file(EngineConfig(kv_cache_bytes=16 << 20), tmp_path / "in.jsonl", tmp_path / "out.jsonl")
    line = json.loads((tmp_path / "out.jsonl").read_text())
    assert code == 1 and line["finish_reason"] == "error" and "simulated engine failure" in line["error"]
