"""What a checkpoint holds and what it costs once loaded (`kvmesh inspect --model DIR`).

`weight_stats` reads only the safetensors headers (no tensor data): tensors, parameters and
bytes per stored dtype, with FP4-packed int8 weights counted as two parameters per byte and
block scales counted apart from parameters; MTP layers are reported on their own line.
"""
from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from .loader import CheckpointError, weight_files

SCALE = re.compile(r"(\.scale|_scale_inv|\.weight_scale_inv)$")


@dataclass
class DtypeStats:
    tensors: int = 0
    params: int = 0
    bytes: int = 0


@dataclass
class WeightStats:
    by_dtype: dict[str, DtypeStats] = field(default_factory=dict)
    params: int = 0              # model parameters (FP4 counted unpacked), scales excluded
    scale_bytes: int = 0
    mtp_params: int = 0
    file_bytes: int = 0          # tensor data bytes across all shards

    def add(self, name: str, dtype: str, shape: list[int], nbytes: int) -> None:
        elements = 1
        for d in shape:
            elements *= d
        s = self.by_dtype.setdefault(dtype, DtypeStats())
        s.tensors, s.bytes = s.tensors + 1, s.bytes + nbytes
        self.file_bytes += nbytes
        if SCALE.search(name):
            self.scale_bytes += nbytes
            s.params += elements
            return
        params = 2 * elements if dtype == "I8" else elements      # int8 weights are packed FP4
        s.params += params
        self.params += params
        if name.startswith("mtp.") or ".mtp." in name:
            self.mtp_params += params


def read_header(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            return json.loads(f.read(n))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable safetensors header ({e})") from None


def weight_stats(model_dir: str | Path) -> WeightStats:
    stats = WeightStats()
    for f in weight_files(Path(model_dir)):
        for name, meta in read_header(f).items():
            if name == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            stats.add(name, meta["dtype"], meta["shape"], end - start)
    return stats


def resident_bytes(model) -> int:
    """Bytes of every distinct tensor storage the loaded model holds (parameters + buffers)."""
    storages = {}
    for t in list(model.parameters()) + list(model.buffers()):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def format_stats(stats: WeightStats) -> str:
    rows = [("dtype", "tensors", "params", "bytes")]
    for dtype, s in sorted(stats.by_dtype.items(), key=lambda kv: -kv[1].bytes):
        rows.append((dtype, f"{s.tensors:,}", f"{s.params:,}", f"{s.bytes:,}"))
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"{r[0]:<{w[0]}}  {r[1]:>{w[1]}}  {r[2]:>{w[2]}}  {r[3]:>{w[3]}}" for r in rows]
    lines += ["", f"parameters {stats.params:,} (FP4 counted unpacked; of which MTP {stats.mtp_params:,}), "
                  f"scales {stats.scale_bytes:,} B, file tensor bytes {stats.file_bytes:,} "
                  f"({stats.file_bytes / 2**30:.2f} GiB)"]
    return "\n".join(lines)
