"""FP8 KV records: V4's byte layout (e4m3 non-RoPE dims + ue8m0 scales + bf16 RoPE dims for
compressed entries, e4m3 + fp32 scale for indexer keys), their round trip, and the sizes
`kvmesh layout` reports for V4-Pro- and V4-Flash-shaped configs."""
from __future__ import annotations

import json

import pytest
import torch

from kvmesh.cluster.cli import main
from kvmesh.kvstore.device.cache_tensors import CacheTensors
from kvmesh.kvstore.device.fp8_kv import Fp8EntryFormat
from kvmesh.kvstore.device.layout import CSA, HCA, SWA, CacheLayout, LayoutParams
from tests.unit.test_cli import V4_PRO

V4_FLASH = {**V4_PRO, "hidden_size": 4096, "num_hidden_layers": 43, "num_attention_heads": 64,
            "n_routed_experts": 256, "o_groups": 8,
            "compress_ratios": [0, 0] + [4, 128] * 20 + [0]}          # 20 CSA + 20 HCA + 3 SWA


def test_v4_entry_records_are_584_and_132_bytes():
    main_fmt, idx_fmt = Fp8EntryFormat.main(512, 64), Fp8EntryFormat.indexer(128)
    assert (main_fmt.data_bytes, main_fmt.scale_bytes, main_fmt.entry_bytes) == (448 + 128, 8, 584)
    assert (idx_fmt.data_bytes, idx_fmt.scale_bytes, idx_fmt.entry_bytes) == (128, 4, 132)


@pytest.mark.parametrize("fmt", [Fp8EntryFormat.main(512, 64), Fp8EntryFormat.main(32, 8),
                                 Fp8EntryFormat.indexer(128), Fp8EntryFormat.indexer(16)])
def test_records_round_trip_within_fp8_precision_and_keep_rope_dims_in_bf16(fmt):
    x = torch.randn(5, fmt.dim, generator=torch.Generator().manual_seed(0)) * 3
    data, scales = fmt.encode(x)
    assert data.dtype == scales.dtype == torch.uint8
    assert data.shape == (5, fmt.data_bytes) and scales.shape == (5, fmt.scale_bytes)
    y = fmt.decode(data, scales, torch.float32)
    q = fmt.quant_dim
    assert torch.equal(y[:, q:], x[:, q:].to(torch.bfloat16).float())
    err = (y[:, :q] - x[:, :q]).abs().max() / x[:, :q].abs().max()
    assert 0 < err < 0.07                                          # e4m3: 3 mantissa bits
    if fmt.ue8m0:                                                  # scales are powers of two
        s = scales[:, :fmt.groups].view(torch.float8_e8m0fnu).float()
        assert torch.equal(s, torch.exp2(torch.log2(s).round()))


def test_paged_blocks_hold_all_entries_data_then_all_scales():
    fmt = Fp8EntryFormat.main(32, 8)
    store = torch.zeros(3, fmt.block_bytes(4), dtype=torch.uint8)
    x = torch.randn(2, 32)
    fmt.write(store, torch.tensor([2, 2]), torch.tensor([1, 3]), x)
    data, scales = fmt.encode(x)
    assert torch.equal(store[2, 1 * fmt.data_bytes:2 * fmt.data_bytes], data[0])
    assert torch.equal(store[2, 4 * fmt.data_bytes + 3 * fmt.scale_bytes:][:fmt.scale_bytes], scales[1])
    assert store[:2].count_nonzero() == 0
    torch.testing.assert_close(fmt.read(store, torch.tensor([2]), torch.float32)[0, [1, 3]],
                               fmt.decode(data, scales, torch.float32))


def test_fp8_cache_tensors_are_bytes_and_sizes_match_the_layout():
    params = LayoutParams((SWA, CSA, HCA), 32, 16, 4, 16, 8, "float32", "fp8", 8)
    layout = CacheLayout.build(params, 16)
    cache = CacheTensors(layout, num_blocks=3, num_slots=2, dtype=torch.float32)
    for lc, spec in zip(cache.layers, layout.specs):
        block = sum(t[0].nbytes for name, t in lc.blocks.items())
        assert block == spec.block_bytes()
        assert all(t.dtype == torch.uint8 for t in lc.blocks.values())
        assert lc.ring.dtype == torch.float32
    assert layout.block_bytes == 4 * (48 + 20) + 1 * 48


@pytest.mark.parametrize("config,bf16,fp8", [(V4_PRO, "9,848.0", "5,511.4"), (V4_FLASH, "6,560.0", "3,671.2")])
def test_kvmesh_layout_reports_both_kv_dtypes_per_token_and_per_million(tmp_path, capsys, config, bf16, fp8):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["layout", "--config", str(path)]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert rows["bfloat16"][1] == bf16 and rows["fp8"][1] == fp8
    per_m = float(rows["fp8"][2])
    assert per_m == round(float(fp8.replace(",", "")) * 1e6 / 2 ** 30, 2)


def test_serve_config_passes_kv_cache_dtype_and_rejects_unknown_ones():
    from pydantic import ValidationError

    from kvmesh.cluster.config import EngineSettings
    assert EngineSettings(kv_cache_dtype="fp8").engine_config().kv_cache_dtype == "fp8"
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        EngineSettings(kv_cache_dtype="int4")
