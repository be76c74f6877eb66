"""vLLM's OpenAI API through the `openai` client: n / best_of, logprobs, echo, penalties,
logit_bias, prompt batches, structured output, usage while streaming, the small
endpoints, API keys, and live /metrics while requests run.

The session's Ray + Serve, two apps for the module: disaggregated at `/` behind two API keys, colocated at
`/colocated` without keys.
"""
from __future__ import annotations

import json
import re
import threading
import time

from pathlib import Path

import httpx
import pytest

from tests.local_serve import small_config

pytestmark = pytest.mark.slow     # a Ray cluster and two Serve apps

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

KEYS = ["sk-kvmesh-one", "sk-kvmesh-two"]
MODES = ["disaggregated", "colocated"]
AUTH = {"Authorization": f"Bearer {KEYS[0]}"}


@pytest.fixture(scope="module")
def urls(local_serve):
    urls = local_serve.deploy_many({"openai": (small_config("disaggregated", ingress={"api_keys": KEYS}), "/")},
                                   shared=("colocated",))      # the session's default colocated app
    return {"disaggregated": urls["openai"], "colocated": urls["colocated"]}


@pytest.fixture(scope="module")
def clients(urls):
    return {m: openai.OpenAI(base_url=f"{urls[m]}/v1", api_key=KEYS[1], max_retries=0) for m in MODES}


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=120, headers=AUTH) as c:
        yield c


def model_of(client) -> str:
    return client.models.list().data[0].id


# ---- API keys -------------------------------------------------------------------------------
def test_without_or_with_a_wrong_key_every_route_but_health_is_401(urls, clients):
    base = urls["disaggregated"]
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEYS[0]}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("GET", "/metrics"), ("POST", "/tokenize"), ("GET", "/version"), ("GET", "/docs"),
                             ("GET", "/openapi.json")):
            r = httpx.request(method, base + path, headers=headers, json={"prompt": "hi"}, timeout=30)
            assert r.status_code == 401, (path, headers, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
            assert "sk-wrong" not in r.text
    assert httpx.get(base + "/health", timeout=30).status_code == 200
    wrong = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    for key in KEYS:   # several keys are accepted
        assert openai.OpenAI(base_url=f"{base}/v1", api_key=key).models.list().data
    text = httpx.get(base + "/metrics", headers=AUTH, timeout=30).text
    assert not any(k in text for k in KEYS)



def test_serves_own_route_list_is_not_served_with_or_without_the_key(urls):
    """/-/routes is answered by Serve's proxy, outside the app and its key: the proxy guard
    (cluster/openai/proxy_guard.py) makes it a 404 for everyone; the proxy's health probe stays."""
    base = urls["disaggregated"]
    for headers in ({}, {"Authorization": "Bearer sk-wrong"}, AUTH):
        r = httpx.get(base + "/-/routes", headers=headers, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
        assert "openai" not in r.text and "colocated" not in r.text
    assert httpx.get(base + "/-/healthz", timeout=30).status_code == 200

def test_the_api_docs_answer_with_the_key_and_without_keys_configured(urls):
    base = urls["disaggregated"]
    spec = httpx.get(base + "/openapi.json", headers=AUTH, timeout=30)
    assert spec.status_code == 200 and "/v1/completions" in spec.json()["paths"]
    page = httpx.get(base + "/docs", headers=AUTH, timeout=30)
    assert page.status_code == 200 and "/openapi.json" in page.text
    open_base = urls["colocated"]          # no keys: open, and the page points under the route prefix
    page = httpx.get(open_base + "/docs", timeout=30)
    assert page.status_code == 200 and "/colocated/openapi.json" in page.text
    assert httpx.get(open_base + "/openapi.json", timeout=30).status_code == 200
    assert httpx.get(base + "/redoc", timeout=30).status_code == 404      # not served: nothing unauthenticated


# ---- n, best_of, logprobs, echo -------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_n_sampled_sequences_differ_and_are_indexed(urls, clients, http, mode):
    c = clients[mode]
    n_prompt = len(http.post(f"{urls[mode]}/tokenize", json={"prompt": "hello world"}).json()["tokens"])
    out = c.completions.create(model=model_of(c), prompt="hello world", n=3, max_tokens=8, temperature=1.0,
                               seed=7, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert sorted(ch.index for ch in out.choices) == [0, 1, 2]
    ids = [tuple(ch.model_extra["token_ids"]) for ch in out.choices]
    assert len(set(ids)) == 3 and all(len(t) == 8 for t in ids)
    assert out.usage.completion_tokens == 24 and out.usage.prompt_tokens == n_prompt
    chat = c.chat.completions.create(model=model_of(c), messages=[{"role": "user", "content": "hi"}], n=2,
                                     max_tokens=5, temperature=0)
    assert [ch.index for ch in chat.choices] == [0, 1]
    assert chat.choices[0].message == chat.choices[1].message   # greedy forks agree (reasoning and content)


@pytest.mark.parametrize("mode", MODES)
def test_n_streams_every_sequence(clients, mode):
    c = clients[mode]
    texts: dict[int, str] = {}
    finish = {}
    for ch in c.completions.create(model=model_of(c), prompt="hello", n=2, max_tokens=6, temperature=0,
                                   stream=True, extra_body={"ignore_eos": True}):
        for choice in ch.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    whole = c.completions.create(model=model_of(c), prompt="hello", max_tokens=6, temperature=0,
                                 extra_body={"ignore_eos": True}).choices[0].text
    assert texts == {0: whole, 1: whole} and finish == {0: "length", 1: "length"}


def test_best_of_returns_the_n_most_likely(clients):
    c = clients["colocated"]
    out = c.completions.create(model=model_of(c), prompt="hello", n=1, best_of=4, max_tokens=5, temperature=1.0,
                               seed=3, logprobs=0)
    assert len(out.choices) == 1 and out.choices[0].index == 0
    assert out.usage.completion_tokens == 20      # all four were generated


@pytest.mark.parametrize("mode", MODES)
def test_top_logprobs_are_sorted_n_long_and_contain_the_sampled_token(clients, mode):
    c = clients[mode]
    out = c.completions.create(model=model_of(c), prompt="hello world", max_tokens=6, temperature=0, logprobs=5)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for tok, tok_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        values = list(top.values())
        assert len(top) == 5 and values == sorted(values, reverse=True)
        assert top[tok] == pytest.approx(tok_lp) and tok_lp == pytest.approx(values[0])   # greedy: the best
    sampled = c.completions.create(model=model_of(c), prompt="hello world", max_tokens=6, temperature=1.5,
                                   seed=1, logprobs=3).choices[0].logprobs
    for tok, top in zip(sampled.tokens, sampled.top_logprobs):
        assert tok in top and len(top) in (3, 4)   # the top 3, plus the sampled token when it is not among them
    chat = c.chat.completions.create(model=model_of(c), messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                     temperature=0, logprobs=True, top_logprobs=4)
    for entry in chat.choices[0].logprobs.content:
        values = [t.logprob for t in entry.top_logprobs]
        assert len(values) == 4 and values == sorted(values, reverse=True)
        assert entry.logprob == pytest.approx(values[0])
    streamed = [e for ch in c.chat.completions.create(
        model=model_of(c), messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0,
        logprobs=True, top_logprobs=4, stream=True) if ch.choices and ch.choices[0].logprobs
        for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in streamed] == \
           [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in chat.choices[0].logprobs.content]


@pytest.mark.parametrize("mode", MODES)
def test_echo_returns_the_prompt_with_its_logprobs(clients, mode):
    c = clients[mode]
    prompt = "hello world, once more"
    plain = c.completions.create(model=model_of(c), prompt=prompt, max_tokens=4, temperature=0)
    out = c.completions.create(model=model_of(c), prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=2)
    choice = out.choices[0]
    assert choice.text == prompt + plain.choices[0].text
    lp = choice.logprobs
    n_prompt = out.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) in (2, 3) for t in lp.top_logprobs[1:])


# ---- penalties, bias, batches ---------------------------------------------------------------
def test_frequency_penalty_changes_a_repetitive_greedy_continuation(clients):
    c = clients["colocated"]
    kw = dict(model=model_of(c), prompt="The quick brown fox", max_tokens=32, temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    plain = c.completions.create(**kw).choices[0].model_extra["token_ids"]
    assert len(set(plain)) < len(plain)
    for penalty in ({"frequency_penalty": 1.5}, {"presence_penalty": 1.5},
                    {"extra_body": {**kw["extra_body"], "repetition_penalty": 2.0}}):
        out = c.completions.create(**{**kw, **penalty}).choices[0].model_extra["token_ids"]
        assert out != plain and len(set(out)) > len(set(plain))


def test_logit_bias_and_min_p(clients):
    c = clients["colocated"]
    tok = c.completions.create(model=model_of(c), prompt="hi", max_tokens=4, temperature=1.0, seed=2,
                               logit_bias={"72": 100}, extra_body={"return_token_ids": True})
    assert tok.choices[0].model_extra["token_ids"] == [72] * 4
    greedy = c.completions.create(model=model_of(c), prompt="hi", max_tokens=6, temperature=0).choices[0].text
    assert c.completions.create(model=model_of(c), prompt="hi", max_tokens=6, temperature=1.0, seed=5,
                                extra_body={"min_p": 1.0}).choices[0].text == greedy


@pytest.mark.parametrize("mode", MODES)
def test_a_list_of_prompts_gives_n_choices_per_prompt_in_order(clients, mode):
    c = clients[mode]
    prompts = ["hello", "the cat sat"]
    single = [c.completions.create(model=model_of(c), prompt=p, max_tokens=5, temperature=0).choices[0].text
              for p in prompts]
    out = c.completions.create(model=model_of(c), prompt=prompts, n=2, max_tokens=5, temperature=0)
    assert [ch.index for ch in out.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in out.choices] == [single[0], single[0], single[1], single[1]]
    tokens = c.completions.create(model=model_of(c), prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0)
    assert len(tokens.choices) == 2 and tokens.usage.prompt_tokens == 5


def test_continuous_usage_stats_put_usage_on_every_chunk(clients):
    c = clients["colocated"]
    chunks = list(c.completions.create(model=model_of(c), prompt="hello", max_tokens=5, temperature=0, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": True},
                                       extra_body={"ignore_eos": True}))
    assert all(ch.usage is not None for ch in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert [ch.usage.completion_tokens for ch in chunks[:-1]] == sorted(ch.usage.completion_tokens for ch in chunks[:-1])


# ---- structured output ----------------------------------------------------------------------
SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
     "required": ["ok", "color"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                      "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
     "required": ["n", "tags"], "additionalProperties": False},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("schema", SCHEMAS, ids=["enum", "int-array", "bool-list"])
def test_json_schema_output_parses_and_validates_streamed_and_not(clients, mode, schema):
    c = clients[mode]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    msgs = [{"role": "user", "content": "answer in JSON"}]
    for temperature in (0.0, 1.0):
        out = c.chat.completions.create(model=model_of(c), messages=msgs, max_tokens=150, temperature=temperature,
                                        seed=4, response_format=fmt)
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)
        text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model=model_of(c), messages=msgs, max_tokens=150, temperature=temperature, seed=4,
            response_format=fmt, stream=True) if ch.choices)
        jsonschema.validate(json.loads(text), schema)
    done = c.completions.create(model=model_of(c), prompt="{", max_tokens=150, temperature=0,
                                extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(done.choices[0].text), schema)


def test_json_object_output_parses(clients):
    c = clients["colocated"]
    out = c.chat.completions.create(model=model_of(c), messages=[{"role": "user", "content": "json"}],
                                    max_tokens=200, temperature=0, response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":
        json.loads(out.choices[0].message.content)
    else:   # an untrained model may wander; whatever it wrote must still be a JSON prefix
        assert out.choices[0].message.content[:1] in "{[\"-0123456789tfn"


def test_unsupported_parameters_are_400_naming_them(clients):
    c = clients["colocated"]
    with pytest.raises(openai.BadRequestError, match="suffix"):
        c.completions.create(model=model_of(c), prompt="hi", suffix="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        c.chat.completions.create(model=model_of(c), messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                  tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
                                  tool_choice={"type": "function", "function": {"name": "g"}})
    with pytest.raises(openai.BadRequestError, match="best_of"):
        c.completions.create(model=model_of(c), prompt="hi", best_of=2, max_tokens=2, stream=True)


# ---- small endpoints ------------------------------------------------------------------------
def test_tokenize_detokenize_version_and_model_card(urls, clients, http):
    base = urls["disaggregated"]
    ids = http.post(f"{base}/tokenize", json={"prompt": "hello"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] > 0
    assert http.post(f"{base}/detokenize", json={"tokens": ids["tokens"]}).json() == {"prompt": "hello"}
    chat = http.post(f"{base}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2
    assert http.post(f"{base}/detokenize", json={"tokens": [10 ** 9]}).status_code == 400
    assert http.get(f"{base}/version").json()["version"]
    c = clients["disaggregated"]
    name = model_of(c)
    assert c.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("no-such-model")


# ---- live metrics ---------------------------------------------------------------------------
def samples(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def total(text: str, name: str, where: str = "") -> float:
    return sum(v for k, v in samples(text, name).items() if where in k)


@pytest.mark.parametrize("mode", MODES)
def test_metrics_are_live_while_requests_run(urls, http, mode):
    base = urls[mode]
    scrape = lambda: http.get(f"{base}/metrics").text  # noqa: E731
    idle = scrape()
    pool = "decode" if mode == "disaggregated" else "colocated"
    assert total(idle, "kvmesh:num_requests_running", pool) == 0
    idle_usage = total(idle, "kvmesh:kv_cache_usage_perc", pool)
    stop = threading.Event()

    def run():
        http.post(f"{base}/v1/completions", json={"prompt": [7] * 300, "max_tokens": 120, "temperature": 0,
                                                   "ignore_eos": True})
    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    running, usage = 0.0, 0.0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(t.is_alive() for t in threads) and not (running and usage > idle_usage):
        text = scrape()
        running = max(running, total(text, "kvmesh:num_requests_running", pool))
        usage = max(usage, total(text, "kvmesh:kv_cache_usage_perc", pool))
        time.sleep(0.05)
    for t in threads:
        t.join()
    stop.set()
    assert running > 0, "no scrape saw a running request during decode"
    assert usage > idle_usage, "KV usage did not rise while requests ran"
    after = scrape()
    assert total(after, "kvmesh:num_requests_running", pool) == 0
    assert total(after, "kvmesh:kv_cache_usage_perc", pool) < usage
    for name in ("kvmesh:request_queue_time_seconds_count", "kvmesh:inter_token_latency_seconds_count",
                 "kvmesh:e2e_request_latency_seconds_count", "kvmesh:kv_cache_free_blocks"):
        assert total(after, name) > 0, name


def test_every_metric_the_grafana_dashboard_plots_is_exported(urls, http):
    dashboard = json.loads((Path(__file__).parents[2] / "deploy" / "grafana" / "kvmesh.json").read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    names = {re.sub(r"_(bucket|total)$", "", n) for n in re.findall(r"kvmesh[_:][a-z0-9_:]+", exprs)}
    text = http.get(f"{urls['disaggregated']}/metrics").text
    exported = {re.sub(r"_total$", "", n) for n in re.findall(r"^# HELP (\S+)", text, re.M)}
    missing = sorted(names - exported)
    assert not missing and len(names) >= 15, missing


def test_prefix_hit_counters_match_cached_tokens(urls, http):
    base = urls["colocated"]
    before = http.get(f"{base}/metrics").text
    prompt = [11 + i % 200 for i in range(300)]      # two full 128-token blocks to reuse
    cached = 0
    for _ in range(2):
        r = http.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0}).json()
        cached += r["usage"]["prompt_tokens_details"]["cached_tokens"]
    after = http.get(f"{base}/metrics").text
    hits = total(after, "kvmesh:prefix_cache_hits_total") - total(before, "kvmesh:prefix_cache_hits_total")
    queries = (total(after, "kvmesh:prefix_cache_queries_total")
               - total(before, "kvmesh:prefix_cache_queries_total"))
    assert cached == 256 and hits == cached and queries == 600
    assert total(after, "kvmesh:prefix_cache_hits_total", 'tier="device"') >= 256
