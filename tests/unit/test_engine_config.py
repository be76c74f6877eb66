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


# ---- one pydantic definition: each kind of rule, its ConfigError, and the serve config's ------
RULES = [  # (field, value, the rule's words): one row per kind of rule a field's type carries
    ("max_batched_tokens", -5, "must be an integer > 0, got -5"),                 # Count: gt=0
    ("grammar_compile_workers", 0, "must be an integer > 0, got 0"),             # Count | None
    ("rank_timeout_s", 0.0, "must be a number > 0, got 0.0"),                   # Seconds: gt=0
    ("store_scrub_interval_s", -0.5, "must be a number >= 0, got -0.5"),        # float, ge=0
    ("host_cache_bytes", "-1", "'-1' is not a size"),                           # BytesOrZero: the suffix parser
    ("max_schema_bytes", "0KiB", "must be an integer > 0, got '0KiB'"),        # Bytes: parsed, then gt=0
    ("grammar_compile_memory_bytes", 1.5, "1.5 is not a size"),                 # a size is an int or a string
    ("max_num_seqs", True, "must be a number, got True"),                      # Strict: a bool is not a number
    ("max_num_seqs", "8", "must be a number, got '8'"),                         # nor a numeric string
    ("max_model_len", 2.5, "must be an integer, got 2.5"),                      # nor a float for an int
    ("grammar_compile_timeout_s", "soon", "must be a number, got 'soon'"),
    ("kernel_backend", "cuda", "'cuda' is not one of auto, torch, triton"),   # one_of(choices)
    ("kv_cache_dtype", None, "must be a string, got NoneType"),
    ("device", "cuda:x", "'cuda:x' is not cpu, cuda or cuda:N"),             # validators
    ("speculative_tokens", "many", "must be an int >= 0 or auto, got 'many'"),
    ("speculative_auto", "1:1,4", "is not a list of batch:k pairs"),
    ("prefix_reuse", "maybe", "must be true or false"),
    ("index", 6379, "must be a string, got int"),
]


@pytest.mark.parametrize("name,value,rule", RULES, ids=[f"{n}={v!r}" for n, v, _ in RULES])
def test_each_kind_of_rule_is_a_config_error_naming_the_field_and_the_rule(name, value, rule):
    from pydantic import ValidationError
    with pytest.raises(ConfigError) as e:
        EngineConfig(**{name: value})
    assert not isinstance(e.value, ValidationError)
    assert str(e.value).startswith(f"EngineConfig.{name}: ") and rule in str(e.value), str(e.value)


BETWEEN = [  # the rules between fields: after-model validators, each naming its fields
    ({"block_tokens": 64, "swa_policy": "periodic:96"}, "EngineConfig.swa_policy: "),
    ({"enable_eplb": True}, "EngineConfig.enable_eplb: needs data_parallel_size > 1"),
    ({"data_parallel_size": 2}, "EngineConfig.data_parallel_size=2 needs enable_expert_parallel=true"),
    ({"data_parallel_size": 2, "enable_expert_parallel": True, "tensor_parallel_size": 2, "enable_eplb": True,
      "eplb_config": {"num_redundant_experts": 2}},
     "EngineConfig.eplb_config.num_redundant_experts=2 is not a multiple of data_parallel_size x "
     "tensor_parallel_size = 2 x 2 = 4"),
    ({"data_parallel_size": 4, "enable_expert_parallel": True, "data_parallel_size_local": 3},
     "EngineConfig.data_parallel_size_local=3 must be an integer >= 1 that divides data_parallel_size=4"),
    ({"data_parallel_size": 2, "enable_expert_parallel": True, "enable_eplb": True,
      "eplb_config": {"num_redundant_experts": 1}}, "EngineConfig.eplb_config.num_redundant_experts=1 is not a multiple"),
]


@pytest.mark.parametrize("kw,words", BETWEEN, ids=[",".join(kw) for kw, _ in BETWEEN])
def test_each_rule_between_fields_is_a_config_error_naming_them(kw, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        EngineConfig(**kw)


@pytest.mark.parametrize("value,words", [
    ('{"num_redundant_experts": -1}', "EngineConfig.eplb_config.num_redundant_experts: must be an integer >= 0, got -1"),
    ({"window_size": True}, "EngineConfig.eplb_config.window_size: must be a number, got True"),
    ({"window_size": 5, "every": 2}, "EngineConfig.eplb_config: unknown key(s) every; expected num_redundant_experts, "
                                     "window_size, step_interval"),
    ("[1, 2]", "EngineConfig.eplb_config: expected an object, got [1, 2]"),
    ("{", "EngineConfig.eplb_config: not JSON"),
])
def test_eplb_settings_from_json_or_a_dict_name_the_key(value, words):
    from kvmesh.workers.engine_config import EplbConfig
    with pytest.raises(ConfigError) as e:
        EngineConfig(eplb_config=value)
    assert str(e.value).startswith(words), str(e.value)
    with pytest.raises(ConfigError) as e:
        EplbConfig.parse(value)
    assert str(e.value).startswith(words), str(e.value)
    assert EngineConfig(eplb_config='{"window_size": 5}').eplb_config == EplbConfig(0, 5, 3000)
    assert EngineConfig(eplb_config={"step_interval": 7}).eplb_config == EplbConfig(step_interval=7)


def test_an_unknown_setting_and_several_bad_ones_are_all_named():
    with pytest.raises(ConfigError, match=r"^EngineConfig: unknown key\(s\) kv_cache_mb; expected model, dtype"):
        EngineConfig(kv_cache_mb=64)
    with pytest.raises(ConfigError) as e:
        EngineConfig(block_tokens=0, device="tpu")
    assert sorted(str(e.value).split("; ")) == ["EngineConfig.block_tokens: must be an integer > 0, got 0",
                                                "EngineConfig.device: 'tpu' is not cpu, cuda or cuda:N"]


def test_errors_never_show_the_store_key_or_the_index_password():
    for kw in ({"store_key": "fifteen-secret!"}, {"index": "http://:hunter22@h:6379/0"},
               {"store_key": b"short-secret"}, {"store_key": 1234567890123456}):
        with pytest.raises(ConfigError) as e:
            EngineConfig(**kw)
        text = str(e.value)
        assert "secret" not in text and "hunter22" not in text and "1234567890" not in text, text


SIZES = [("8MiB", 8 << 20), ("1GiB", 1 << 30), ("512KiB", 512 << 10), ("1.5 GiB", 3 << 29), ("2tib", 2 << 40),
         ("4096", 4096), ("64B", 64), (12345, 12345)]


@pytest.mark.parametrize("text,size", SIZES, ids=[str(t) for t, _ in SIZES])
def test_every_size_field_takes_bytes_or_a_binary_suffix(text, size):
    names = [f.name for f in dataclasses.fields(EngineConfig) if f.metadata.get("unit") == "bytes"]
    assert set(names) == {"kv_cache_bytes", "store_capacity_bytes", "host_cache_bytes", "store_scrub_pass_bytes",
                          "max_schema_bytes", "grammar_compile_memory_bytes", "restore_prefetch_bytes"}
    config = EngineConfig(**{name: text for name in names})
    assert all(getattr(config, name) == size for name in names)
    serve = ServeConfig.model_validate({"engine": {"kv_cache_bytes": text}, "decode": {"engine": {"host_cache_bytes": text}}})
    assert serve.pool_engine(serve.decode).host_cache_bytes == size == serve.pool_engine(serve.prefill).kv_cache_bytes


def test_auto_values_and_defaults_are_kept():
    c = EngineConfig(kernel_backend="auto", kv_cache_dtype="auto", swa_policy="auto", speculative_tokens="auto")
    assert (c.kernel_backend, c.kv_cache_dtype, c.swa_policy, c.speculative_tokens) == ("auto",) * 4
    assert EngineConfig(speculative_tokens="0").speculative_tokens == 0
    d = EngineConfig()
    assert (d.block_tokens, d.max_num_seqs, d.max_batched_tokens, d.host_cache_bytes, d.store_scrub_pass_bytes,
            d.max_schema_bytes, d.grammar_compile_memory_bytes, d.speculative_tokens, d.speculative_auto) == \
        (128, 64, 1024, 256 << 20, 1 << 30, 64 << 10, 2 << 30, None, "1:2,16:1,32:0")
    assert all(getattr(d, f.name) == f.default for f in dataclasses.fields(EngineConfig) if f.name != "eplb_config")


def test_a_config_pickles_replaces_and_converts_as_a_dataclass():
    import pickle

    from ray import cloudpickle
    c = EngineConfig(kv_cache_bytes="64MiB", store_key="k" * 16, data_parallel_size=2, enable_expert_parallel=True,
                     eplb_config='{"num_redundant_experts": 2}')
    assert pickle.loads(pickle.dumps(c)) == c == cloudpickle.loads(cloudpickle.dumps(c))
    assert dataclasses.asdict(c)["eplb_config"] == {"num_redundant_experts": 2, "window_size": 1000, "step_interval": 3000}
    assert dataclasses.replace(c, device="cuda:1").device == "cuda:1"
    with pytest.raises(ConfigError, match="EngineConfig.device"):          # a replaced value is checked too
        dataclasses.replace(c, device="gpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.device = "cuda"
    from pathlib import Path
    assert EngineConfig(model=Path("/m"), store=Path("/s")).model == "/m"


# the serve config's engine key and a pool's engine overrides refuse what EngineConfig refuses,
# with EngineConfig's words (the parallel sizes are pool keys: tests/unit/test_parallel_config.py)
SERVE_KEYS = {f.name for f in dataclasses.fields(EngineConfig) if f.metadata["serve"]}
SERVED = [(name, value, rule) for name, value, rule in BAD + RULES if name in SERVE_KEYS]


@pytest.mark.parametrize("name,value,rule", SERVED, ids=[f"{n}={v!r}" for n, v, _ in SERVED])
def test_the_engine_key_and_a_pools_overrides_refuse_the_same_values_naming_the_field(name, value, rule):
    with pytest.raises(ConfigError) as e:
        EngineConfig(**{name: value})
    words = str(e.value)
    with pytest.raises(ConfigFileError) as engine_key:
        load_config(None, {f"engine.{name}": value})
    assert words in str(engine_key.value), str(engine_key.value)
    with pytest.raises(ConfigFileError) as pool_key:
        load_config(None, {f"decode.engine.{name}": value})
    assert f"decode.engine: {words}" in str(pool_key.value), str(pool_key.value)


def test_a_parallel_size_under_engine_names_the_pool_keys():
    for where in ("engine", "decode.engine"):
        with pytest.raises(ConfigFileError, match="tensor_parallel_size is a pool's key, not an engine setting: "
                                                  "prefill.tensor_parallel_size"):
            load_config(None, {f"{where}.tensor_parallel_size": 2})
