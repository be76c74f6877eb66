"""Prefix identity: model fingerprints and block hash chains (DESIGN §3).

Two nodes that serve the same model with the same cache layout must compute the
same hash for the same token prefix, and nodes that serve anything different
must never agree. Both follow from deriving every hash from a **model
fingerprint** (a digest over the model config, weights identity, dtype,
block_tokens and cache layout version) instead of any process-level seed.

Block hash chain (the Dynamo / Mooncake convention)::

    tokens  | block 0          | block 1          | ... | partial tail |
    local   | xxh3_64(b0, s)   | xxh3_64(b1, s)   |     | (not hashed) |
    seq     | local[0]         | xxh3_64(seq[0] ‖ local[1], s) ...     |

where `b_i` is block i's token ids as u32 little-endian, `s` is the seed
derived from the fingerprint, and `‖` concatenates two u64 little-endian.
`seq[i]` identifies the whole prefix `tokens[: (i + 1) * block_tokens]`.
Python's `hash()` is never used: it is salted per process.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping, Sequence

import numpy as np
import xxhash

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
HASH_HEX_CHARS = 16  # a u64 hash as zero-padded lowercase hex
FINGERPRINT_MIN_CHARS = 16  # namespaces use fingerprint[:16]
NAMESPACE_CHARS = 16
KEY_ID_CHARS = 16
_HEX_RE = re.compile(r"^[0-9a-f]+$")
NAMESPACE_RE = re.compile(r"^[0-9a-f]{%d}(-k[0-9a-f]{%d})?$" % (NAMESPACE_CHARS, KEY_ID_CHARS))
_SEED_DOMAIN = b"kvmesh-block-seed-v1:"  # keeps the seed distinct from other uses of the digest


def model_fingerprint(
    config: Mapping[str, Any],
    weights_identity: str,
    dtype: str,
    block_tokens: int,
    layout_version: int,
) -> str:
    """Return a 32-char hex XXH3-128 digest identifying a model + cache layout.

    The digest is taken over canonical JSON (sorted keys, no whitespace) of all
    five fields, so a change to any of them gives a different fingerprint, while
    the key order of `config` does not matter. `config` must be JSON
    serialisable (TypeError otherwise); `block_tokens` must be positive and
    `layout_version` non-negative (ValueError otherwise).
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    if layout_version < 0:
        raise ValueError(f"layout_version must be >= 0, got {layout_version}")
    payload = {
        "config": config,
        "weights_identity": weights_identity,
        "dtype": dtype,
        "block_tokens": int(block_tokens),
        "layout_version": int(layout_version),
    }
    try:
        canonical = json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"model config is not canonical-JSON serialisable: {e}") from e
    return xxhash.xxh3_128_hexdigest(canonical.encode("utf-8"))


def check_fingerprint(fingerprint: str) -> str:
    """Return `fingerprint` if it is lowercase hex of >= 16 chars, else raise ValueError."""
    if (
        not isinstance(fingerprint, str)
        or len(fingerprint) < FINGERPRINT_MIN_CHARS
        or not _HEX_RE.match(fingerprint)
    ):
        raise ValueError(
            f"fingerprint must be lowercase hex of at least {FINGERPRINT_MIN_CHARS} chars "
            f"(see model_fingerprint), got {fingerprint!r}"
        )
    return fingerprint


def store_namespace(fingerprint: str, key_id: str | None = None) -> str:
    """The store directory and index namespace of one fingerprint's objects.

    Unkeyed: ``fingerprint[:16]``. Under a store key: ``{fingerprint[:16]}-k{key_id}``
    (kvstore.store.mac.StoreKey.key_id), so objects of different keys, and unkeyed ones, never
    share a path or an index entry: a node with a wrong key loses only its own reuse.
    Block hashes do not depend on the key (nodes of any key agree on prefix identity).
    """
    ns = check_fingerprint(fingerprint)[:NAMESPACE_CHARS]
    if key_id is None:
        return ns
    if len(key_id) != KEY_ID_CHARS or not _HEX_RE.match(key_id):
        raise ValueError(f"key_id must be {KEY_ID_CHARS} lowercase hex chars, got {key_id!r}")
    return f"{ns}-k{key_id}"


def fingerprint_seed(fingerprint: str) -> int:
    """Return the u64 hashing seed derived from a model fingerprint."""
    check_fingerprint(fingerprint)
    return xxhash.xxh3_64_intdigest(_SEED_DOMAIN + fingerprint.encode("ascii"))


def _tokens_u32le(tokens: Sequence[int]) -> bytes:
    """Token ids as one u32 little-endian byte string; ValueError outside [0, 2**32)."""
    try:
        arr = np.asarray(tokens)
    except OverflowError as e:
        raise ValueError(f"token ids must fit in u32: {e}") from e
    if arr.size == 0:
        return b""
    if arr.ndim != 1:
        raise ValueError(f"tokens must be a flat sequence, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers in [0, {U32_MAX}], got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > U32_MAX:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} is outside u32 [0, {U32_MAX}]")
    return arr.astype("<u4", copy=False).tobytes()


def chain_hash(parent: int | None, local: int, seed: int) -> int:
    """Return seq hash of a block given its parent's seq hash (None for block 0)."""
    if parent is None:
        return local
    return xxhash.xxh3_64_intdigest(
        parent.to_bytes(8, "little") + local.to_bytes(8, "little"), seed=seed
    )


def block_hashes(tokens: Sequence[int], block_tokens: int, seed: int) -> list[int]:
    """Return the seq hashes (u64 ints) of every *full* block of `tokens`.

    `len(result) == len(tokens) // block_tokens`; a partial tail block is never
    hashed. Raises ValueError for token ids outside u32 or block_tokens <= 0.
    """
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    if not 0 <= seed <= U64_MAX:
        raise ValueError(f"seed must be a u64, got {seed}")
    data = _tokens_u32le(tokens)
    stride = 4 * block_tokens
    n_full = len(data) // stride
    hashes: list[int] = []
    parent: int | None = None
    for i in range(n_full):
        local = xxhash.xxh3_64_intdigest(data[i * stride : (i + 1) * stride], seed=seed)
        parent = chain_hash(parent, local, seed)
        hashes.append(parent)
    return hashes


def hash_hex(h: int) -> str:
    """Return a u64 hash as 16 lowercase hex chars (object and key names)."""
    if not 0 <= h <= U64_MAX:
        raise ValueError(f"hash must be a u64, got {h}")
    return f"{h:0{HASH_HEX_CHARS}x}"


def parse_hash_hex(text: str) -> int:
    """Inverse of `hash_hex`; ValueError unless `text` is 16 lowercase hex chars."""
    if len(text) != HASH_HEX_CHARS or not _HEX_RE.match(text):
        raise ValueError(f"not a {HASH_HEX_CHARS}-char hex hash: {text!r}")
    return int(text, 16)


class PrefixHasher:
    """Block hashing bound to one model fingerprint and block size.

    Immutable after construction; safe to share between threads.
    """

    def __init__(self, fingerprint: str, block_tokens: int) -> None:
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        self._fingerprint = check_fingerprint(fingerprint)
        self._block_tokens = block_tokens
        self._seed = fingerprint_seed(fingerprint)

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def block_tokens(self) -> int:
        return self._block_tokens

    @property
    def seed(self) -> int:
        return self._seed

    def hashes(self, tokens: Sequence[int]) -> list[int]:
        """Seq hashes of the full blocks of `tokens` (see `block_hashes`)."""
        return block_hashes(tokens, self._block_tokens, self._seed)

    def next_hash(self, parent: int | None, block: Sequence[int]) -> int:
        """Seq hash of one more full block after `parent` (None: the first block).

        Lets a decoder extend a chain as blocks fill without rehashing the prefix.
        """
        data = _tokens_u32le(block)
        if len(data) != 4 * self._block_tokens:
            raise ValueError(
                f"a block has exactly {self._block_tokens} tokens, got {len(data) // 4}"
            )
        return chain_hash(parent, xxhash.xxh3_64_intdigest(data, seed=self._seed), self._seed)

    def __repr__(self) -> str:
        return f"PrefixHasher(fingerprint={self._fingerprint[:16]}…, block_tokens={self._block_tokens})"
