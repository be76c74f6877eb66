"""The weights' content identity, part of the model fingerprint (kvstore.hashing).

Every byte of every safetensors file is hashed (XXH3-128), so two checkpoints that
differ anywhere (a middle layer included) never share cached KV. Hashing a large
checkpoint takes a while, so each file's digest is cached by (name, size, mtime):

    {model_dir}/.kvmesh-weights-id.json        beside the checkpoint, when writable
    ~/.cache/kvmesh/weights-id/{dir hash}.json  otherwise (a read-only checkpoint)

A file whose size or mtime changed is hashed again; a cache file that cannot be read
or written is ignored (the digest is then recomputed, never guessed).
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

import xxhash

from .loader import weight_files

log = logging.getLogger(__name__)
CACHE_NAME = ".kvmesh-weights-id.json"
CHUNK_BYTES = 16 << 20
VERSION = 2          # 1 hashed only the first and last MiB of each file


def file_digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(CHUNK_BYTES)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _cache_paths(model_dir: Path) -> list[Path]:
    fallback = Path.home() / ".cache" / "kvmesh" / "weights-id"
    return [model_dir / CACHE_NAME, fallback / f"{xxhash.xxh3_64_hexdigest(str(model_dir.resolve()).encode())}.json"]


def _read_cache(paths: list[Path]) -> dict:
    for p in paths:
        try:
            data = json.loads(p.read_text())
            if isinstance(data, dict) and data.get("version") == VERSION and isinstance(data.get("files"), dict):
                return data["files"]
        except (OSError, ValueError):
            continue
    return {}


def _write_cache(paths: list[Path], files: dict) -> None:
    text = json.dumps({"version": VERSION, "files": files}, indent=1, sort_keys=True)
    for p in paths:
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=p.parent, prefix=".tmp-", delete=False) as f:
                f.write(text)
            os.replace(f.name, p)
            return
        except OSError:
            try:
                os.unlink(f.name)
            except (OSError, UnboundLocalError, NameError):
                pass
            continue
    log.warning("could not cache the weights identity of %s anywhere; it is recomputed at every start", paths[0].parent)


def weights_identity(model_dir: str | Path) -> str:
    """A digest of every weight byte (file names, sizes and contents), cached per file."""
    model_dir = Path(model_dir)
    paths = _cache_paths(model_dir)
    cached, files, changed = _read_cache(paths), {}, False
    total = xxhash.xxh3_128()
    for f in weight_files(model_dir):
        st = f.stat()
        entry = cached.get(f.name)
        if not (isinstance(entry, dict) and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns
                and isinstance(entry.get("xxh3_128"), str)):
            log.info("hashing %s (%d MiB) for the model fingerprint", f, st.st_size >> 20)
            entry, changed = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "xxh3_128": file_digest(f)}, True
        files[f.name] = entry
        total.update(f"{f.name}\0{st.st_size}\0{entry['xxh3_128']}\n".encode())
    if changed or set(files) != set(cached):
        _write_cache(paths, files)
    return total.hexdigest()
