"""EngineConfig is checked once, at construction, and the serve config and the CLI are
derived from its fields (same names, defaults and checks)."""
from __future__ import annotations

import dataclasses

import pytest

from kvmesh.cluster.cli import build_parser
from kvmesh.cluster.cli.generate import engine_config
from kvmesh.cluster.config import ConfigFileError, ServeConfig, load_config
from kvmesh.workers.engine import EngineConfig as ReExported
from kvmesh.workers.engine_config import EngineConfig, parse_bytes
from kvmesh.workers.model.args import ConfigError

BAD = [("swa_policy", "sometimes", "full, periodic:P"), ("swa_policy", "periodic:100", "multiple of block_tokens"),
       ("index", "http://redis:6379", "redis://"), ("device", "gpu", "cuda:N"),
       ("kernel_backend", "cuda", "auto, torch, triton"), ("kv_cache_dtype", "fp4", "auto, bfloat16, fp8"),
       ("dtype", "int8", "float32, bfloat16, float16"), ("block_tokens", 0, "> 0"),
       ("kv_cache_bytes", -1, "> 0"), ("kv_cache_bytes", "8MB", "KiB, MiB"), ("max_num_seqs", 0, "> 0"),
       ("max_batched_tokens", 0, "> 0"), ("max_model_len", 0, "> 0"), ("store_capacity_bytes", 0, "> 0"),
       ("host_cache_bytes", -1, ">= 0"), ("speculative_tokens", -1, ">= 0"), ("store_read_timeout_s", 0, "> 0"),
       ("max_num_seqs", "many", "a number"), ("store_key", "short", "at least 16 bytes"),
       ("store_scrub_interval_s", -1, ">= 0"), ("store_scrub_pass_bytes", 0, "> 0")]


@pytest.mark.parametrize("name,value,allowed", BAD, ids=[f"{n}={v}" for n, v, _ in BAD])
def test_each_bad_field_is_a_config_error_naming_the_field_and_what_it_accepts(name, value, allowed):
    with pytest.raises(ConfigError) as e:
        EngineConfig(**{name: value})
    assert f"EngineConfig.{name}" in str(e.value) and allowed in str(e.value)


def test_defaults_are_valid_and_the_engine_module_re_exports_the_class():
    assert ReExported is EngineConfig
    c = EngineConfig()
    assert (c.kv_cache_bytes, c.swa_policy, c.index, c.device) == (256 << 20, "full", "local", "cpu")
    assert str(c.policy) == "full"


def test_sizes_are_bytes_given_as_ints_or_with_a_binary_suffix():
    assert EngineConfig(kv_cache_bytes="64MiB", host_cache_bytes="0").host_cache_bytes == 0
    assert EngineConfig(kv_cache_bytes="64MiB").kv_cache_bytes == 64 << 20
    assert (parse_bytes("1.5 GiB"), parse_bytes(4096), parse_bytes(None)) == (3 << 29, 4096, None)
    for index in ("redis://h:1/0", "rediss://h:1/0", "unix:///tmp/r.sock"):
        assert EngineConfig(index=index).index == index


def test_the_repr_hides_the_store_key_and_the_index_password():
    text = repr(EngineConfig(index="redis://:hunter22@h:6379/0", store_key="k" * 16))
    assert "hunter22" not in text and "kkkk" not in text


def test_the_serve_engine_key_has_every_engine_field_with_the_same_default():
    engine = ServeConfig().engine
    fields = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.metadata.get("serve", True)}
    assert set(type(engine).model_fields) == set(fields)
    for name, default in fields.items():
        if name not in ("store", "store_key"):      # a server keeps a store; the key is a secret
            assert getattr(engine, name) == default, name
    assert ServeConfig().pool_engine(ServeConfig().decode) == EngineConfig(store=engine.store)


def test_the_serve_config_refuses_what_engine_config_refuses_and_names_the_key(tmp_path):
    for text, words in [("engine: {swa_policy: sometimes}\n", "EngineConfig.swa_policy"),
                        ("engine: {kv_cache_bytes: 12 apples}\n", "kv_cache_bytes"),
                        ("decode: {engine: {device: tpu}}\n", "decode.engine: "),
                        ("engine: {kv_cache_mb: 64}\n", "kv_cache_mb is now kv_cache_bytes")]:
        path = tmp_path / "bad.yaml"
        path.write_text(text)
        with pytest.raises(ConfigFileError, match=words):
            load_config(path)


def test_config_file_errors_never_show_the_store_key_or_the_redis_password(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("engine: {swa_policy: sometimes, index: 'redis://:hunter22@h:6379/0', "
                    "store_key: sixteen-bytes-secret}\n")
    with pytest.raises(ConfigFileError) as e:
        load_config(path)
    assert "swa_policy" in str(e.value) and "hunter22" not in str(e.value) and "secret" not in str(e.value)


def test_a_pool_overrides_only_the_engine_settings_it_names():
    config = ServeConfig.model_validate({"engine": {"kv_cache_bytes": "64MiB", "max_num_seqs": 8},
                                         "decode": {"engine": {"kv_cache_bytes": "1GiB"}}})
    decode, prefill = config.pool_engine(config.decode, "d1"), config.pool_engine(config.prefill)
    assert (decode.kv_cache_bytes, decode.max_num_seqs, decode.worker_id) == (1 << 30, 8, "d1")
    assert (prefill.kv_cache_bytes, prefill.max_num_seqs) == (64 << 20, 8)


def test_a_dumped_serve_config_reloads_to_the_same_engines(tmp_path):
    import yaml
    config = ServeConfig.model_validate({"engine": {"kv_cache_bytes": "64MiB"},
                                         "prefill": {"engine": {"max_num_seqs": 4}}})
    path = tmp_path / "kvmesh.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    again = load_config(path)
    for pool in ("prefill", "decode", "colocated"):
        assert again.pool_engine(getattr(again, pool)) == config.pool_engine(getattr(config, pool))
    assert again.pool_engine(again.prefill).max_num_seqs == 4 and again.decode.engine.model_dump() == {}


def test_the_generate_flags_are_the_cli_fields_of_engine_config():
    args = build_parser().parse_args(["generate", "--input", "x", "--kv-cache-bytes", "8MiB", "--swa-policy",
                                      "zero", "--no-prefix-reuse", "--require-store", "--device", "cpu"])
    config = engine_config(args)
    assert (config.kv_cache_bytes, config.swa_policy, config.prefix_reuse, config.require_store) == \
        (8 << 20, "zero", False, True)
    defaults = engine_config(build_parser().parse_args(["generate", "--input", "x"]))
    assert defaults == EngineConfig()
