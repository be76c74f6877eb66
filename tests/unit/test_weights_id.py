"""The weights identity (workers/checkpoint/weights_id.py): it covers every byte of the
checkpoint, and is cached by size and mtime (in the user's cache when the checkpoint is read-only)."""
from __future__ import annotations

import os
import shutil

import pytest
from safetensors.torch import load_file, save_file

from tests.helpers import write_tiny_checkpoint
from kvmesh.workers.checkpoint import weights_id


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
