"""The cache layout (kvstore/device/layout.py, DESIGN §1): bytes per token, per block and per state
slot for each layer type, checked by hand and against V4-Pro's shapes; block sizes and dtypes it
refuses."""
from __future__ import annotations

import dataclasses

import pytest

from kvmesh.kvstore.device.layout import CSA, HCA, SWA, CacheLayout, LayoutError, LayoutParams

V4_PRO_TYPES = (HCA, HCA) + (CSA, HCA) * 29 + (CSA,)
V4_PRO = LayoutParams(layer_types=V4_PRO_TYPES, head_dim=512, index_head_dim=128, csa_ratio=4, hca_ratio=128,
                      window=128, dtype="bfloat16")


def test_v4_pro_classical_cache_is_9848_bytes_per_token():
    layout = CacheLayout.build(V4_PRO, 128)
    assert layout.layer_count_by_type() == {CSA: 30, HCA: 31}
    assert layout.bytes_per_token() == 9848
    per_type = layout.bytes_per_token_by_type()
    assert per_type[CSA] == 30 * (512 + 128) * 2 / 4 and per_type[HCA] == 31 * 512 * 2 / 128
    classical = layout.bytes_per_token() * 2 ** 20
    assert round(classical / 2 ** 30, 2) == 9.62
    assert layout.footprint(2 ** 20) == classical + layout.slot_bytes


def test_block_and_slot_bytes_per_layer_type():
    params = LayoutParams((SWA, CSA, HCA), head_dim=64, index_head_dim=32, csa_ratio=4, hca_ratio=16,
                          window=8, dtype="float32")
    layout = CacheLayout.build(params, 32)
    csa_block = (32 // 4) * (64 + 32) * 4
    hca_block = (32 // 16) * 64 * 4
    assert layout.block_bytes == csa_block + hca_block
    ring = 8 * 64 * 4
    csa_state = ring + (2 * 4 * 2 * 64 + 2 * 4 * 2 * 32 + 2 * 4 * 64 + 2 * 4 * 32) * 4
    hca_state = ring + 2 * 16 * 64 * 4
    assert layout.slot_bytes == ring + csa_state + hca_state
    assert layout.footprint(33) == 2 * layout.block_bytes + layout.slot_bytes
    assert layout.swa_bytes_per_token() == 3 * 64 * 4


@pytest.mark.parametrize("block_tokens", [64, 96, 0, -128])
def test_block_tokens_not_a_multiple_of_the_ratio_lcm_is_refused(block_tokens):
    with pytest.raises(LayoutError, match="multiple of 128"):
        CacheLayout.build(V4_PRO, block_tokens)


def test_unknown_cache_dtype_is_refused():
    with pytest.raises(LayoutError, match="unsupported cache dtype"):
        CacheLayout.build(LayoutParams((CSA,), 64, 32, 4, 128, 8, dtype="float64"), 128)


def test_swa_only_model_accepts_any_block_size():
    layout = CacheLayout.build(LayoutParams((SWA, SWA), 64, 32, 4, 128, 8, "bfloat16"), 5)
    assert layout.block_bytes == 0 and layout.slot_bytes == 2 * 8 * 64 * 2


def test_fp8_v4_pro_sizes_follow_from_the_record_dtype():
    layout = CacheLayout.build(dataclasses.replace(V4_PRO, kv_dtype="fp8", rope_dim=64), 128)
    csa = next(s for s in layout.specs if s.ratio == 4)
    assert csa.compressor().entries.nbytes == 32 * 584 and csa.indexer().entries.nbytes == 32 * 132
    assert round(layout.bytes_per_token(), 1) == 5511.4
