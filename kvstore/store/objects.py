"""The store object format: one self-verifying file per block or checkpoint (DESIGN §4).

Byte layout (all integers little-endian)::

    offset  size  field
    0       8     MAGIC            b"KVMESH01"
    8       4     FORMAT_VERSION   u32
    12      4     header length H  u32, bytes of the JSON header
    16      8     checksum         u64, XXH3-64 (seed 0) over bytes [0, 16) ++ [24, end)
    24      H     JSON header      utf-8, see below
    24+H    pad   zeros up to DATA_ALIGN
    D       ...   data: tensors back to back, each starting at a DATA_ALIGN multiple
    D+L     32    MAC (only when the header has "mac"): HMAC-SHA256 with the deployment's
                  store key over bytes [0, D+L) (kvstore.store.mac)

    D = align_up(24 + H, DATA_ALIGN), L = data_length; the object is exactly D + L bytes
    (+ 32 with a MAC).

JSON header::

    {"fingerprint": str, "kind": "block"|"checkpoint", "hash": 16-hex,
     "parent": 16-hex|null, "token_count": int, "byteorder": "little",
     "data_length": int, "mac": "hmac-sha256" (absent without a key),
     "tensors": [{"name", "dtype" (torch dtype name, e.g. "bfloat16"), "shape",
                  "offset" (from D), "nbytes"}, ...]}

The checksum covers every byte except itself and the MAC, so truncation, a flipped
bit anywhere, or a spliced header is detected; the MAC makes a forgery detectable
too. `decode_object` verifies all of it before returning anything; every failure
is a `CorruptObjectError` (`UnauthenticatedObjectError` for a MAC failure).
"""

from __future__ import annotations

import functools
import json
import math
import mmap
import struct
import sys
from typing import Iterable, NamedTuple

import torch
import xxhash

from kvmesh.kvstore.hashing import hash_hex, parse_hash_hex
from kvmesh.kvstore.store.mac import MAC_NAME, MAC_SIZE, StoreKey

MAGIC = b"KVMESH01"
FORMAT_VERSION = 1
PREFIX_STRUCT = struct.Struct("<8sIIQ")  # magic, version, header length, checksum
PREFIX_SIZE = PREFIX_STRUCT.size  # 24
CHECKSUM_OFFSET = 16  # the checksum field occupies [16, 24)
DATA_ALIGN = 64  # tensor data alignment in bytes (cache line; any dtype's itemsize divides it)
KINDS = ("block", "checkpoint")

_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
        "int64", "int32", "int16", "int8", "uint8", "bool",
    )
    if hasattr(torch, name)
}


class CorruptObjectError(Exception):
    """A store object failed verification; the message names what is wrong."""


class UnauthenticatedObjectError(CorruptObjectError):
    """A store object has no MAC, or one that the reader's key does not verify."""


class CacheObject(NamedTuple):
    """A verified store object. `tensors` may be views into the decoded buffer."""

    fingerprint: str
    kind: str
    hash: int
    parent: int | None
    token_count: int
    tensors: dict[str, torch.Tensor]
    data: memoryview | None = None   # the verified tensor bytes (set when decoded lazily)
    table: tuple = ()                # ((name, dtype, shape, offset, nbytes), ...) offsets into `data`
    data_start: int = 0              # where `data` starts in the object's bytes


def _align_up(n: int) -> int:
    return (n + DATA_ALIGN - 1) // DATA_ALIGN * DATA_ALIGN


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if _DTYPES.get(name) != dtype:
        raise TypeError(f"dtype {dtype} cannot be stored; supported: {sorted(_DTYPES)}")
    return name


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of `t` (host byte order), without a copy when already contiguous."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


def encode_object_parts(
    fingerprint: str,
    kind: str,
    h: int,
    parent: int | None,
    token_count: int,
    tensors: dict[str, torch.Tensor],
    key: StoreKey | None = None,
) -> list[bytes | memoryview]:
    """Encode an object as a list of buffers whose concatenation is the object.

    Lets a writer stream it without building one big buffer. With `key` the object
    carries a MAC. Raises ValueError for a bad kind / token_count and TypeError for an
    unsupported dtype.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if token_count < 0:
        raise ValueError(f"token_count must be >= 0, got {token_count}")
    table, blobs, offset = [], [], 0
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r}")
        blob = _tensor_bytes(t)
        offset = _align_up(offset)
        table.append({
            "name": name, "dtype": _dtype_name(t.dtype), "shape": list(t.shape),
            "offset": offset, "nbytes": blob.nbytes,
        })
        blobs.append((offset, blob))
        offset += blob.nbytes
    fields = {
        "fingerprint": fingerprint, "kind": kind, "hash": hash_hex(h),
        "parent": None if parent is None else hash_hex(parent),
        "token_count": int(token_count), "byteorder": sys.byteorder,
        "data_length": offset, "tensors": table,
    }
    if key is not None:
        fields["mac"] = MAC_NAME
    header = json.dumps(fields, separators=(",", ":")).encode()
    data_start = _align_up(PREFIX_SIZE + len(header))
    body: list[bytes | memoryview] = [header, bytes(data_start - PREFIX_SIZE - len(header))]
    pos = 0
    for blob_offset, blob in blobs:
        body += [bytes(blob_offset - pos), blob]
        pos = blob_offset + blob.nbytes
    head = PREFIX_STRUCT.pack(MAGIC, FORMAT_VERSION, len(header), 0)
    checksum = _checksum(head[:CHECKSUM_OFFSET], body)
    parts = [PREFIX_STRUCT.pack(MAGIC, FORMAT_VERSION, len(header), checksum), *body]
    return parts + [key.mac(parts)] if key is not None else parts


def encode_object(
    fingerprint: str,
    kind: str,
    h: int,
    parent: int | None,
    token_count: int,
    tensors: dict[str, torch.Tensor],
    key: StoreKey | None = None,
) -> bytes:
    """Encode one store object (see the module docstring for the layout)."""
    return b"".join(encode_object_parts(fingerprint, kind, h, parent, token_count, tensors, key))


def _checksum(prefix: bytes | memoryview, body: Iterable[bytes | memoryview]) -> int:
    hasher = xxhash.xxh3_64(prefix)
    for part in body:
        hasher.update(part)
    return hasher.intdigest()


def decode_object(
    buf: bytes | bytearray | memoryview | mmap.mmap,
    expect_fingerprint: str,
    expect_hash: int,
    expect_kind: str | None = None,
    lazy: bool = False,
    key: StoreKey | None = None,
) -> CacheObject:
    """Verify and decode one store object; raise CorruptObjectError on any mismatch.

    `lazy` skips building per-tensor views: the result carries the verified `data`
    bytes and the checked `table` instead, for callers that unpack many objects of one
    layout at once.

    With `key`, an object without a MAC that this key verifies is rejected
    (`UnauthenticatedObjectError`); without one, a MAC present is not checked.

    Tensors are zero-copy views (`torch.frombuffer`) when `buf` is writable
    (a bytearray, a copy-on-write mmap); a read-only buffer is copied once so no
    tensor ever aliases read-only memory. Views keep `buf` alive.
    """
    view = memoryview(buf).cast("B")
    if view.readonly:
        view = memoryview(bytearray(view))
    try:
        return _decode(view, expect_fingerprint, expect_hash, expect_kind, lazy, key)
    except CorruptObjectError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError, RuntimeError,
            struct.error) as e:     # a checksummed but malformed object: still just a corrupt one
        raise CorruptObjectError(f"malformed object: {type(e).__name__}: {e}") from e


def _decode(view: memoryview, expect_fingerprint: str, expect_hash: int, expect_kind: str | None, lazy: bool,
            key: StoreKey | None) -> CacheObject:
    header, raw = _verified_header(view, key)
    if header.get("fingerprint") != expect_fingerprint:
        raise CorruptObjectError(
            f"foreign fingerprint {str(header.get('fingerprint'))[:16]}, "
            f"expected {expect_fingerprint[:16]}"
        )
    try:
        h = parse_hash_hex(header["hash"])
        parent = None if header["parent"] is None else parse_hash_hex(header["parent"])
        kind, token_count = header["kind"], int(header["token_count"])
        entries = header["tensors"]
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptObjectError(f"malformed header field: {type(e).__name__}: {e}") from e
    if h != expect_hash:
        raise CorruptObjectError(f"object holds hash {hash_hex(h)}, expected {hash_hex(expect_hash)}")
    if kind not in KINDS or (expect_kind is not None and kind != expect_kind):
        raise CorruptObjectError(f"object kind {kind!r}, expected {expect_kind or KINDS}")
    data_start = _align_up(PREFIX_SIZE + len(raw))
    table = _checked_table(int(header["data_length"]), _table_text(raw, entries))
    if lazy:
        data = view[data_start:data_start + int(header["data_length"])]
        return CacheObject(expect_fingerprint, kind, h, parent, token_count, {}, data, table, data_start)
    tensors = {e[0]: _tensor_view(view, data_start, e) for e in table}
    return CacheObject(expect_fingerprint, kind, h, parent, token_count, tensors)


def _verified_header(view: memoryview, key: StoreKey | None) -> tuple[dict, bytes]:
    """Check magic, version, lengths, checksum and MAC; return the parsed JSON header and its bytes."""
    if len(view) < PREFIX_SIZE:
        raise CorruptObjectError(f"truncated: {len(view)} bytes, shorter than the {PREFIX_SIZE}-byte prefix")
    magic, version, header_len, checksum = PREFIX_STRUCT.unpack_from(view)
    if magic != MAGIC:
        raise CorruptObjectError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CorruptObjectError(f"format version {version}, this build reads {FORMAT_VERSION}")
    if PREFIX_SIZE + header_len > len(view):
        raise CorruptObjectError(f"truncated: header of {header_len} bytes runs past the end ({len(view)} bytes)")
    try:
        raw = bytes(view[PREFIX_SIZE : PREFIX_SIZE + header_len])
        header = json.loads(raw)
        end = _align_up(PREFIX_SIZE + header_len) + int(header["data_length"])
        mac = header.get("mac")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptObjectError(f"unreadable header: {type(e).__name__}: {e}") from e
    if mac not in (None, MAC_NAME):
        raise CorruptObjectError(f"unknown MAC {mac!r}, this build knows {MAC_NAME!r}")
    expected_len = end + (MAC_SIZE if mac else 0)
    if len(view) != expected_len:
        what = "truncated" if len(view) < expected_len else "trailing bytes"
        raise CorruptObjectError(f"{what}: object is {len(view)} bytes, header says {expected_len}")
    actual = _checksum(view[:CHECKSUM_OFFSET], [view[PREFIX_SIZE:end]])
    if actual != checksum:
        raise CorruptObjectError(f"checksum mismatch: stored {checksum:016x}, computed {actual:016x}")
    if key is not None:
        if not mac:
            raise UnauthenticatedObjectError("no MAC: written without a store key, not trusted under one")
        if not key.verify([view[:end]], view[end:]):
            raise UnauthenticatedObjectError("MAC mismatch: not written with this deployment's store key")
    if header.get("byteorder") != sys.byteorder:
        raise CorruptObjectError(f"byte order {header.get('byteorder')!r}, this host is {sys.byteorder}")
    return header, raw


_TABLE_TEXTS: dict[bytes, str] = {}      # a header's tensor-table text -> itself, checked to parse as its table
_TABLE_TEXTS_MAX = 256


def _table_text(header: bytes, entries) -> str:
    """The JSON text of a header's tensor table, the key `_checked_table` caches by. Objects of
    one layout carry the same text, so it is taken from the header's bytes (`"tensors":[` occurs
    once unescaped; the list runs to the header's last `]`) rather than re-encoded (a third of a
    decode); a text not seen before counts only once it parses to the header's own table."""
    start, end = header.rfind(b'"tensors":['), header.rfind(b"]") + 1
    if start >= 0 and end > start:
        text = header[start + len(b'"tensors":'):end]
        known = _TABLE_TEXTS.get(text)
        if known is not None:
            return known
        try:
            if json.loads(text) == entries:
                if len(_TABLE_TEXTS) < _TABLE_TEXTS_MAX:
                    _TABLE_TEXTS[text] = text.decode()
                return text.decode()
        except ValueError:
            pass
    return json.dumps(entries, separators=(",", ":"))


@functools.lru_cache(maxsize=64)
def _checked_table(data_length: int, entries_json: str) -> tuple:
    """The checked tensor table; objects of one layout share it, so it is parsed once."""
    entries = json.loads(entries_json)
    if not isinstance(entries, list):
        raise CorruptObjectError("tensor table is not a list")
    return tuple(_checked_entry(data_length, e) for e in entries)


def _checked_entry(data_length: int, entry: dict) -> tuple[str, torch.dtype, tuple[int, ...], int, int]:
    """One tensor-table entry, after bounds and size checks."""
    try:
        name, dtype = entry["name"], _DTYPES[entry["dtype"]]
        shape = tuple(int(d) for d in entry["shape"])
        offset, nbytes = int(entry["offset"]), int(entry["nbytes"])
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptObjectError(f"malformed tensor table entry {str(entry)[:200]}: {e!r}") from e
    if not isinstance(name, str):
        raise CorruptObjectError(f"tensor name {str(name)[:80]} is not a string")
    if min(shape, default=0) < 0 or math.prod(shape) * dtype.itemsize != nbytes:
        raise CorruptObjectError(f"tensor {name!r}: shape {list(shape)} of {dtype} is not {nbytes} bytes")
    if offset < 0 or offset % DATA_ALIGN or offset + nbytes > data_length:
        raise CorruptObjectError(f"tensor {name!r}: bytes [{offset}, {offset + nbytes}) outside the data")
    return name, dtype, shape, offset, nbytes


def _tensor_view(view: memoryview, data_start: int, entry: tuple) -> torch.Tensor:
    """A tensor viewing its (checked) bytes in `view`."""
    _, dtype, shape, offset, nbytes = entry
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(view, dtype=dtype, count=nbytes // dtype.itemsize, offset=data_start + offset).view(shape)
