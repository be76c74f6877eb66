"""The `kvmesh` command line: the console script as a subprocess where it matters (a mixed
batch, the layout table), `kvmesh.cluster.cli.main` in-process for the rest (same code, no start-up cost)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.cluster.cli import main
from kvmesh.workers.engine_config import EplbConfig
from tests.helpers import random_prompt, write_tiny_checkpoint

NAME, BLOCK = "swa_csa_hca", 16
OUTPUT_FIELDS = {"id", "token_ids", "text", "logprobs", "finish_reason", "prompt_tokens", "cached_tokens"}
V4_PRO_RATIOS = [128, 128] + [4, 128] * 29 + [4]          # 61 layers: 30 CSA + 31 HCA
V4_PRO = {"model_type": "deepseek_v4", "vocab_size": 129280, "hidden_size": 7168, "num_hidden_layers": 61,
          "num_attention_heads": 128, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1536,
          "moe_intermediate_size": 3072, "n_routed_experts": 384, "num_experts_per_tok": 6, "o_groups": 16,
          "index_head_dim": 128, "index_n_heads": 64, "sliding_window": 128, "compress_ratios": V4_PRO_RATIOS,
          "torch_dtype": "bfloat16"}


def kvmesh(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("kvmesh", path=str(Path(sys.executable).parent))
    assert exe, "the kvmesh console script is not installed in this environment"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp(NAME), NAME)


def generate(checkpoint: Path, tmp_path: Path, lines: list[str]) -> tuple[subprocess.CompletedProcess, list[dict]]:
    src, dst = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    src.write_text("".join(line + "\n" for line in lines))
    proc = kvmesh("generate", "--model", str(checkpoint), "--input", str(src), "--output", str(dst),
                  "--block-tokens", str(BLOCK), "--kv-cache-bytes", "8MiB")
    results = [json.loads(line) for line in dst.read_text().splitlines()] if dst.exists() else []
    return proc, results


def request(rid: str, **kw) -> str:
    return json.dumps({"id": rid, **kw})


GOOD = [request("tokens", prompt_token_ids=random_prompt(30), max_tokens=5, temperature=0, ignore_eos=True),
        request("text", prompt="hello kvmesh", max_tokens=3, temperature=0.8, seed=1, ignore_eos=True),
        request("stopped", prompt_token_ids=random_prompt(7, seed=1), max_tokens=4, temperature=0, ignore_eos=True,
                stop_token_ids=[], min_tokens=1)]


@pytest.mark.slow     # gloo ranks
def test_generate_with_data_parallel_attention_equals_one_process(checkpoint, tmp_path):
    src = tmp_path / "requests.jsonl"
    src.write_text("".join(line + "\n" for line in GOOD))
    results = {}
    for name, flags in (("one", []), ("dp2", ["--data-parallel-size", "2", "--enable-expert-parallel"])):
        dst = tmp_path / f"{name}.jsonl"
        assert main(["generate", "--model", str(checkpoint), "--input", str(src), "--output", str(dst),
                     "--block-tokens", str(BLOCK), "--kv-cache-bytes", "8MiB", *flags]) == 0
        results[name] = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["token_ids"] for r in results["dp2"]] == [r["token_ids"] for r in results["one"]]
    assert [r["id"] for r in results["dp2"]] == ["tokens", "text", "stopped"]


@pytest.mark.slow     # gloo ranks
def test_generate_with_data_parallel_attention_drafts_by_default_with_the_greedy_tokens_of_no_drafts(
        tmp_path, capsys):
    """The built-in model has an MTP layer: DP=2 + EP drafts with it unless --speculative-tokens 0."""
    src = tmp_path / "requests.jsonl"
    src.write_text("".join(request(f"r{i}", prompt=p, max_tokens=16, temperature=0, ignore_eos=True) + "\n"
                           for i, p in enumerate(["In the beginning", "And God said, Let there be"])))
    results, errs = {}, {}
    for name, flags in (("default", []), ("off", ["--speculative-tokens", "0"])):
        dst = tmp_path / f"{name}.jsonl"
        assert main(["generate", "--input", str(src), "--output", str(dst), "--kv-cache-bytes", "16MiB",
                     "--data-parallel-size", "2", "--enable-expert-parallel", *flags]) == 0
        results[name] = [json.loads(line)["token_ids"] for line in dst.read_text().splitlines()]
        errs[name] = capsys.readouterr().err
    assert results["default"] == results["off"]
    assert "speculative decoding:" in errs["default"] and "speculative decoding:" not in errs["off"]


def test_generate_completes_every_line_with_all_output_fields(checkpoint, tmp_path):
    # in-process through the same entry point as the console script (the subprocess path is
    # exercised by the mixed-batch test below)
    src, dst = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    src.write_text("".join(line + "\n" for line in GOOD))
    code = main(["generate", "--model", str(checkpoint), "--input", str(src), "--output", str(dst),
                 "--block-tokens", str(BLOCK), "--kv-cache-bytes", "8MiB"])
    assert code == 0
    results = [json.loads(line) for line in dst.read_text().splitlines()]
    assert [r["id"] for r in results] == ["tokens", "text", "stopped"]
    for r, n_prompt, n_out in zip(results, (30, len("hello kvmesh"), 7), (5, 3, 4)):
        assert set(r) == OUTPUT_FIELDS
        assert r["prompt_tokens"] == n_prompt and r["cached_tokens"] == 0
        assert len(r["token_ids"]) == len(r["logprobs"]) == n_out
        assert r["finish_reason"] == "length" and isinstance(r["text"], str)
        assert all(lp <= 0 for lp in r["logprobs"])


@pytest.mark.slow     # the console script as a subprocess
def test_bad_lines_get_error_results_and_the_rest_complete(checkpoint, tmp_path):
    lines = [GOOD[0],
             '{"id": "broken", "prompt": ',                                          # malformed JSON
             request("hot", prompt="x", temperature=-1),                              # invalid sampling
             request("few", prompt="x", max_tokens=0),
             request("seedy", prompt="x", seed="abc"),
             request("stops", prompt="x", stop_token_ids=5),                          # not a list
             request("huge", prompt_token_ids=[5, 10 ** 6]),                          # outside the vocabulary
             request("long", prompt_token_ids=random_prompt(10), max_tokens=10 ** 7),  # too long
             json.dumps({"prompt": "no id"}),
             request("extra", prompt="x", colour="blue"),
             GOOD[1]]
    proc, results = generate(checkpoint, tmp_path, lines)
    assert proc.returncode == 1
    assert len(results) == len(lines)
    by_id = {r["id"]: r for r in results if r["id"] is not None}
    for rid in ("tokens", "text"):
        assert set(by_id[rid]) == OUTPUT_FIELDS and by_id[rid]["finish_reason"] == "length"
    errors = [r for r in results if "error" in r]
    assert len(errors) == len(lines) - 2
    assert all(r["finish_reason"] == "error" for r in errors)
    assert "invalid JSON" in results[1]["error"] and "line 2" in results[1]["error"]
    for rid, words in {"hot": "temperature", "few": "max_tokens", "seedy": "seed", "stops": "stop_token_ids",
                       "huge": "outside the vocabulary", "long": "exceeds", "extra": "colour"}.items():
        assert words in by_id[rid]["error"], by_id[rid]
    assert "'id'" in results[8]["error"]


def test_generate_with_an_unreadable_input_exits_2(checkpoint, tmp_path, capsys):
    assert main(["generate", "--model", str(checkpoint), "--input", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_generate_with_a_bad_checkpoint_exits_2_with_a_message(tmp_path, capsys):
    (tmp_path / "requests.jsonl").write_text(request("a", prompt="x") + "\n")
    assert main(["generate", "--model", str(tmp_path / "nowhere"), "--input", str(tmp_path / "requests.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow     # the console script as a subprocess
def test_layout_of_a_v4_pro_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(V4_PRO))
    proc = kvmesh("layout", "--config", str(path))
    assert proc.returncode == 0, proc.stderr
    total = next(line for line in proc.stdout.splitlines() if line.startswith("total"))
    assert total.split() == ["total", "61", "9,848.0"]
    assert "compressed_sparse_attention" in proc.stdout and "heavily_compressed_attention" in proc.stdout
    assert "(9.62 GiB)" in proc.stdout


@pytest.mark.parametrize("config,message", [
    ("{not json", "not valid JSON"),
    (json.dumps({**V4_PRO, "model_type": "llama"}), "unsupported model_type"),
    (json.dumps({k: v for k, v in V4_PRO.items() if k != "head_dim"}), "head_dim"),
    (None, "config.json not found"),
])
def test_layout_of_a_bad_config_exits_2_with_a_message(tmp_path, capsys, config, message):
    path = tmp_path / "config.json"
    if config is not None:
        path.write_text(config)
    assert main(["layout", "--config", str(path)]) == 2
    assert message in capsys.readouterr().err


def test_layout_with_a_block_size_that_splits_windows_exits_2(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(V4_PRO))
    assert main(["layout", "--config", str(path), "--block-tokens", "64"]) == 2
    assert "multiple of 128" in capsys.readouterr().err


def test_layout_without_a_config_exits_2(capsys):
    assert main(["layout"]) == 2
    assert "--config" in capsys.readouterr().err


def test_generate_with_speculative_tokens_on_a_checkpoint_without_mtp_exits_2_naming_it(checkpoint, tmp_path, capsys):
    (tmp_path / "requests.jsonl").write_text(request("a", prompt="x") + "\n")
    assert main(["generate", "--model", str(checkpoint), "--input", str(tmp_path / "requests.jsonl"),
                 "--block-tokens", str(BLOCK), "--kv-cache-bytes", "8MiB", "--speculative-tokens", "2"]) == 2
    assert "MTP" in capsys.readouterr().err


def serve_args(*argv: str):
    from kvmesh.cluster.cli import build_parser
    return build_parser().parse_args(["serve", *argv])


def test_serve_speaks_vllm_flags_for_both_pools_and_the_pool_forms_where_they_differ():
    from kvmesh.cluster.cli.serve import serve_config
    config = serve_config(serve_args("--tensor-parallel-size", "2", "--enable-expert-parallel", "--kv-cache-dtype",
                                     "fp8", "--max-model-len", "4096", "--max-num-seqs", "8",
                                     "--decode-max-num-seqs", "32", "--prefill-tensor-parallel-size", "1",
                                     "--served-model-name", "v4", "--data-parallel-size", "1",
                                     "--allow-special-tokens-in-content"))
    assert config.ingress.allow_special_tokens_in_content
    assert not serve_config(serve_args()).ingress.allow_special_tokens_in_content      # off by default
    prefill, decode = config.pool_engine(config.prefill), config.pool_engine(config.decode)
    assert (prefill.tensor_parallel_size, decode.tensor_parallel_size) == (1, 2)
    assert prefill.enable_expert_parallel and decode.enable_expert_parallel
    assert (prefill.max_num_seqs, decode.max_num_seqs) == (8, 32)
    assert prefill.max_model_len == decode.max_model_len == 4096
    assert prefill.kv_cache_dtype == decode.kv_cache_dtype == "fp8" and config.ingress.model_name == "v4"
    assert len(config.decode.deployment_options("decode")["placement_group_bundles"]) == 2
    assert "placement_group_bundles" not in config.prefill.deployment_options("prefill")
    colocated = serve_config(serve_args("--mode", "colocated", "--max-num-seqs", "4"))
    assert colocated.pool_engine(colocated.colocated).max_num_seqs == 4
    dp = serve_config(serve_args("--mode", "colocated", "--data-parallel-size", "2", "--enable-expert-parallel",
                                 "--data-parallel-size-local", "2"))         # every rank on one node: served
    assert dp.colocated.data_parallel_size_local == 2 and dp.colocated.nodes == 1
    engine = dp.pool_engine(dp.colocated)
    assert (engine.data_parallel_size, engine.enable_expert_parallel, engine.tensor_parallel_size) == (2, True, 1)
    assert len(dp.colocated.deployment_options("colocated")["placement_group_bundles"]) == 2
    wide = serve_config(serve_args("--data-parallel-size", "4", "--enable-expert-parallel", "--address", "auto",
                                   "--decode-data-parallel-size-local", "2"))     # decode over 2 nodes
    assert (wide.decode.nodes, wide.prefill.nodes) == (2, 1)
    assert wide.pool_engine(wide.decode).data_parallel_size_local == 2
    assert wide.decode.deployment_options("decode")["placement_group_strategy"] == "STRICT_SPREAD"
    assert not engine.enable_eplb
    eplb = serve_config(serve_args("--mode", "colocated", "--data-parallel-size", "2", "--enable-expert-parallel",
                                   "--enable-eplb", "--eplb-config", '{"num_redundant_experts": 2, "step_interval": 50}'))
    engine = eplb.pool_engine(eplb.colocated)
    assert engine.enable_eplb and engine.eplb_config == EplbConfig(2, 1000, 50)


def test_serve_flags_that_agree_with_the_config_file_are_accepted(tmp_path):
    from kvmesh.cluster.cli.serve import serve_config
    path = tmp_path / "kvmesh.yaml"
    path.write_text("engine: {max_num_seqs: 16, kv_cache_dtype: fp8}\ndecode: {engine: {max_num_seqs: 32}}\n"
                    "prefill:\n")                                   # an empty section takes the flags too
    config = serve_config(serve_args("--config", str(path), "--decode-max-num-seqs", "32", "--prefill-max-num-seqs",
                                     "16", "--kv-cache-dtype", "fp8", "--tensor-parallel-size", "2"))
    assert (config.pool_engine(config.prefill).max_num_seqs, config.pool_engine(config.decode).max_num_seqs) == (16, 32)
    assert config.decode.tensor_parallel_size == config.prefill.tensor_parallel_size == 2


@pytest.mark.parametrize("yaml,argv,names", [
    ("decode: {tensor_parallel_size: 4, num_cpus: 1}", ["--tensor-parallel-size", "2"],
     ["--tensor-parallel-size 2", "decode.tensor_parallel_size: 4"]),
    ("engine: {max_num_seqs: 16}", ["--decode-max-num-seqs", "32"], ["--decode-max-num-seqs 32", "engine.max_num_seqs: 16"]),
    ("prefill: {engine: {max_model_len: 2048}}", ["--max-model-len", "4096"],
     ["--max-model-len 4096", "prefill.engine.max_model_len: 2048"]),
    ("decode: {engine: {kv_cache_dtype: bfloat16}}", ["--kv-cache-dtype", "fp8"],
     ["--kv-cache-dtype fp8", "decode.engine.kv_cache_dtype: bfloat16"]),
    ("ingress: {model_name: flash}", ["--served-model-name", "pro"], ["--served-model-name pro", "ingress.model_name: flash"]),
    ("ingress: {allow_special_tokens_in_content: false}", ["--allow-special-tokens-in-content"],
     ["--allow-special-tokens-in-content disagrees", "ingress.allow_special_tokens_in_content: False"]),
    ("decode: {enable_expert_parallel: true}", ["--no-decode-enable-expert-parallel"],
     ["--no-decode-enable-expert-parallel disagrees", "decode.enable_expert_parallel: True"]),
    ("mode: colocated\ncolocated: {data_parallel_size: 4, enable_expert_parallel: true}", ["--data-parallel-size", "2"],
     ["--data-parallel-size 2", "colocated.data_parallel_size: 4"]),
], ids=["pool_key", "inherited_engine_key", "pool_engine_key", "shared_key", "ingress_key", "ingress_switch", "bool",
     "data_parallel"])
def test_a_serve_flag_that_disagrees_with_the_config_file_exits_2_naming_both(tmp_path, capsys, yaml, argv, names):
    path = tmp_path / "kvmesh.yaml"
    path.write_text(yaml + "\n")
    assert main(["serve", "--config", str(path), *argv]) == 2
    err = capsys.readouterr().err
    assert all(name in err for name in names) and str(path) in err, err


@pytest.mark.parametrize("argv,message", [
    (["--decode-data-parallel-size", "3", "--enable-expert-parallel"],   # the built-in model: 4 experts
     "decode.data_parallel_size: data_parallel_size=3 does not divide n_routed_experts=4"),
    (["--data-parallel-size", "0"], "data_parallel_size"),
    (["--mode", "colocated", "--data-parallel-size", "2"],
     "colocated: EngineConfig.data_parallel_size=2 needs enable_expert_parallel=true"),
    (["--mode", "colocated", "--data-parallel-size", "2", "--tensor-parallel-size", "4", "--enable-expert-parallel"],
     "colocated.data_parallel_size: data_parallel_size x tensor_parallel_size = 2 x 4 = 8 does not divide "
     "n_routed_experts=4"),
    (["--mode", "colocated", "--data-parallel-size", "3", "--enable-expert-parallel"],   # the built-in model: 4 experts
     "colocated.data_parallel_size: data_parallel_size=3 does not divide n_routed_experts=4"),
    (["--mode", "colocated", "--prefill-tensor-parallel-size", "2"],
     "--prefill-tensor-parallel-size sets the prefill pool, but mode colocated runs one pool"),
    (["--tensor-parallel-size", "0"], "tensor_parallel_size"),
    (["--decode-data-parallel-size", "4", "--decode-data-parallel-size-local", "3", "--enable-expert-parallel"],
     "data_parallel_size_local 3 does not divide data_parallel_size 4"),
    (["--data-parallel-size-local", "0"], "decode.data_parallel_size_local"),
    (["--data-parallel-size", "4", "--decode-data-parallel-size-local", "2", "--enable-expert-parallel"],
     "decode.data_parallel_size_local 2 places each replica over 2 nodes, and a local Ray is one node: "
     "attach to a cluster with --address"),
    (["--mode", "colocated", "--enable-eplb"], "colocated: EngineConfig.enable_eplb: needs data_parallel_size > 1"),
    (["--mode", "colocated", "--data-parallel-size", "2", "--enable-expert-parallel", "--enable-eplb", "--eplb-config",
      '{"num_redundant_experts": 1}'], "eplb_config.num_redundant_experts=1 is not a multiple of data_parallel_size=2"),
    (["--max-num-seqs", "0"], "max_num_seqs"),
    (["--decode-tensor-parallel-size", "3"],       # the built-in model: 4 heads, 2 output groups
     "decode.tensor_parallel_size: tensor_parallel_size=3 does not divide num_attention_heads=4, o_groups=2"),
])
def test_serve_flags_that_cannot_apply_exit_2_before_starting_anything(capsys, argv, message):
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err



def test_serve_gives_a_local_ray_loopback_and_the_proxy_guard_and_keeps_what_is_set():
    from kvmesh.cluster.cli.serve import ray_env, set_ray_env
    assert ray_env(None) == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "UCX_NET_DEVICES": "lo",
                             "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "kvmesh.cluster.openai.proxy_guard.middlewares"}
    assert ray_env("10.0.0.1:6379") == {}        # an attached cluster's processes run already
    env = {"UCX_NET_DEVICES": "all"}
    set_ray_env(None, env)
    assert env == {**ray_env(None), "UCX_NET_DEVICES": "all"}

def test_an_eplb_config_flag_that_is_no_json_object_is_a_usage_error(capsys):
    for text in ("[1]", "{nope"):
        with pytest.raises(SystemExit) as e:
            main(["serve", "--eplb-config", text])
        assert e.value.code == 2 and "argument --eplb-config: invalid json_object value" in capsys.readouterr().err


def test_generate_exits_1_with_an_error_field_when_the_engine_fails(tmp_path, monkeypatch):
    from kvmesh.cluster.cli.generate import run_batch_file
    from kvmesh.workers.engine import Engine
    from kvmesh.workers.engine_config import EngineConfig
    (tmp_path / "in.jsonl").write_text('{"id": "a", "prompt": "hi", "max_tokens": 2}\n')

    def broken_step(self):
        raise RuntimeError("simulated engine failure")
    monkeypatch.setattr(Engine, "step", broken_step)
    code = run_batch_file(EngineConfig(kv_cache_bytes=16 << 20), tmp_path / "in.jsonl", tmp_path / "out.jsonl")
    line = json.loads((tmp_path / "out.jsonl").read_text())
    assert code == 1 and line["finish_reason"] == "error" and "simulated engine failure" in line["error"]
