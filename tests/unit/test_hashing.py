"""Prefix identity (DESIGN §3, invariant 4): same tokens + model -> same hashes everywhere,
anything different -> no shared entry."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

from kvmesh.kvstore.hashing import (
    PrefixHasher,
    block_hashes,
    fingerprint_seed,
    hash_hex,
    model_fingerprint,
    parse_hash_hex,
)

REPO = Path(__file__).resolve().parents[2]
CONFIG = {"model_type": "deepseek_v4", "hidden_size": 64}
FP = model_fingerprint(CONFIG, "sha256:0000", "bfloat16", 4, 1)


def _reference_chain(tokens: list[int], block_tokens: int, seed: int) -> list[int]:
    """The DESIGN §3 formula written out with struct, independent of the module."""
    out: list[int] = []
    for i in range(len(tokens) // block_tokens):
        block = tokens[i * block_tokens : (i + 1) * block_tokens]
        local = xxhash.xxh3_64_intdigest(struct.pack(f"<{block_tokens}I", *block), seed=seed)
        out.append(local if i == 0 else xxhash.xxh3_64_intdigest(struct.pack("<QQ", out[-1], local), seed=seed))
    return out


def test_known_vectors_are_pinned() -> None:
    assert FP == "e792f0eaee1256ec26fd348af13b0726"
    assert fingerprint_seed(FP) == 3894985260775581251
    assert [hash_hex(h) for h in block_hashes(list(range(10)), 4, 0)] == ["a1d0bd893c9531ac", "db33494ff9c294ff"]
    assert [hash_hex(h) for h in PrefixHasher(FP, 4).hashes(list(range(10)))] == [
        "52e5c63b8cdc0279",
        "c6d227d45c7429e5",
    ]


@pytest.mark.parametrize("block_tokens", [1, 4, 128])
def test_chain_matches_the_design_formula(block_tokens: int) -> None:
    tokens = [(i * 2654435761) % 2**32 for i in range(3 * block_tokens + 1)]
    seed = fingerprint_seed(FP)
    assert block_hashes(tokens, block_tokens, seed) == _reference_chain(tokens, block_tokens, seed)


def test_hashes_are_stable_across_processes() -> None:
    tokens = list(range(1000, 1300))
    script = (
        "import json, sys; from kvmesh.kvstore.hashing import PrefixHasher; "
        f"print(json.dumps(PrefixHasher({FP!r}, 32).hashes(list(range(1000, 1300)))))"
    )
    results = set()
    for hash_seed in ("1", "2"):  # different salts for Python's hash(): must not matter
        env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(REPO)}
        out = subprocess.run(
            [sys.executable, "-c", script], env=env, cwd=REPO, capture_output=True, text=True, check=True
        )
        results.add(tuple(json.loads(out.stdout)))
    assert results == {tuple(PrefixHasher(FP, 32).hashes(tokens))}


def test_partial_tail_block_is_not_hashed() -> None:
    hasher = PrefixHasher(FP, 4)
    assert hasher.hashes(list(range(11))) == hasher.hashes(list(range(8)))
    assert len(hasher.hashes(list(range(11)))) == 2
    assert hasher.hashes([1, 2, 3]) == []


def test_each_hash_identifies_the_whole_prefix() -> None:
    hasher = PrefixHasher(FP, 4)
    a = hasher.hashes([1, 2, 3, 4, 5, 6, 7, 8])
    b = hasher.hashes([9, 2, 3, 4, 5, 6, 7, 8])  # same second block, different first
    assert a[1] != b[1]
    assert hasher.hashes([1, 2, 3, 4]) == a[:1]


def test_next_hash_extends_the_chain() -> None:
    hasher = PrefixHasher(FP, 4)
    full = hasher.hashes(list(range(12)))
    assert hasher.next_hash(None, [0, 1, 2, 3]) == full[0]
    assert hasher.next_hash(full[1], [8, 9, 10, 11]) == full[2]
    with pytest.raises(ValueError, match="exactly 4 tokens"):
        hasher.next_hash(full[0], [1, 2])


@pytest.mark.parametrize(
    "change",
    [
        {"config": {**CONFIG, "hidden_size": 65}},
        {"weights_identity": "sha256:0001"},
        {"dtype": "float8_e4m3fn"},
        {"block_tokens": 8},
        {"layout_version": 2},
    ],
)
def test_any_model_change_gives_a_new_fingerprint_and_new_hashes(change: dict) -> None:
    fields = {
        "config": CONFIG, "weights_identity": "sha256:0000", "dtype": "bfloat16", "block_tokens": 4, "layout_version": 1
    }
    other = model_fingerprint(**{**fields, **change})
    assert other != FP
    tokens = list(range(64))
    assert set(PrefixHasher(FP, 4).hashes(tokens)).isdisjoint(PrefixHasher(other, 4).hashes(tokens))


def test_fingerprint_ignores_config_key_order() -> None:
    reordered = dict(reversed(list(CONFIG.items())))
    assert model_fingerprint(reordered, "sha256:0000", "bfloat16", 4, 1) == FP


def test_different_block_tokens_or_tokens_never_match() -> None:
    tokens = list(range(256))
    by_4, by_8 = PrefixHasher(FP, 4).hashes(tokens), PrefixHasher(FP, 8).hashes(tokens)
    other_tokens = PrefixHasher(FP, 4).hashes([t + 1 for t in tokens])
    assert set(by_4).isdisjoint(by_8)
    assert set(by_4).isdisjoint(other_tokens)
    assert len(set(by_4)) == len(by_4)


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], [True]])
def test_token_ids_outside_u32_are_rejected(bad: list) -> None:
    with pytest.raises(ValueError):
        block_hashes(bad * 4, 4, 0)


def test_u32_boundary_tokens_are_accepted() -> None:
    assert len(block_hashes([0, 2**32 - 1, 7, 8], 4, 0)) == 1


@pytest.mark.parametrize("fingerprint", ["", "xyz", "ABCDEF0123456789", "abc"])
def test_malformed_fingerprints_are_rejected(fingerprint: str) -> None:
    with pytest.raises(ValueError, match="fingerprint"):
        PrefixHasher(fingerprint, 4)


def test_hash_hex_is_16_chars_and_roundtrips() -> None:
    for h in (0, 1, 2**64 - 1, 0xDEADBEEF):
        text = hash_hex(h)
        assert len(text) == 16 and parse_hash_hex(text) == h
    with pytest.raises(ValueError):
        hash_hex(2**64)
