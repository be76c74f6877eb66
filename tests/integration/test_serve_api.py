"""The OpenAI API over HTTP against a local Ray Serve app, disaggregated and colocated.

The session's Ray + Serve (tests/integration/conftest.py), three apps for the module: disaggregated at `/` (a
prompt of at most DECODE_PREFILL_MAX tokens runs on decode, no handoff), colocated at `/colocated`, and disaggregated with NIXL unavailable (every handoff falls back to a Ray
object) and two ingress replicas at `/fallback`. Greedy output must equal the offline engine's, token for token.
"""
from __future__ import annotations

import json
import time

import httpx
import pytest

from kvmesh.cluster.chat.dsv4_encode import CHAT as CHAT_MODE
from kvmesh.cluster.chat.dsv4_encode import END_THINK, THINKING, encode_messages
from scripts.default_chat_data import TOOLS
from tests.helpers import random_prompt, sse_events
from tests.local_serve import small_config
from kvmesh.workers.checkpoint.default_model import default_model_dir
from kvmesh.workers.checkpoint.tokenizer import load_tokenizer
from kvmesh.workers.engine import Engine
from kvmesh.workers.sampling.params import SamplingParams

pytestmark = pytest.mark.slow     # a Ray cluster and three Serve apps

MODES = ["disaggregated", "colocated"]
PROMPTS = ["hello world", "The quick brown fox jumps over the lazy dog. " * 7, [5, 17, 300, 42, 99, 7]]
MAX_TOKENS = 12
# The disaggregated app's: an unread handoff is freed after this. Not shorter: decode must start
# its READ before release - 1 s (NIXL's expiry margin) or it falls back to the Ray copy, and under
# CI's load a 4 s timeout once left it 3 s too few (one fallback in test_models_health_and_metrics).
RELEASE_TIMEOUT_S = 10.0
INGRESS_REPLICAS = 2        # the fallback app's: /metrics must add up over them
DECODE_PREFILL_MAX = 4      # the disaggregated app's: a prompt this short runs whole on decode (no handoff)


@pytest.fixture(scope="module")
def urls(local_serve):
    no_nixl = small_config("disaggregated", handoff={"nixl_backend": "NO_SUCH_BACKEND"},
                           ingress={"num_replicas": INGRESS_REPLICAS})
    disagg = small_config("disaggregated", handoff={"release_timeout_s": RELEASE_TIMEOUT_S},
                          ingress={"decode_prefill_max_tokens": DECODE_PREFILL_MAX})
    urls = local_serve.deploy_many({"disagg": (disagg, "/"), "fallback": (no_nixl, "/fallback")},
                                   shared=("colocated",))      # the session's default colocated app
    return {"disaggregated": urls["disagg"], "colocated": urls["colocated"], "fallback": urls["fallback"]}


@pytest.fixture(scope="module")
def client():
    with httpx.Client(timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def offline():
    return Engine(small_config().engine.engine_config())


def greedy(offline: Engine, prompt, max_tokens: int = MAX_TOKENS):
    return offline.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0))[0]


def stream_events(client: httpx.Client, url: str, body: dict) -> list[dict]:
    with client.stream("POST", url, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r.iter_lines()))
    assert events[-1] == "[DONE]"
    return events[:-1]


@pytest.mark.parametrize("mode", MODES + ["fallback"])
def test_greedy_completion_equals_offline_engine(urls, client, offline, mode):
    for prompt in PROMPTS:
        r = client.post(f"{urls[mode]}/v1/completions", json={
            "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True, "logprobs": 0})
        assert r.status_code == 200, r.text
        body, want = r.json(), greedy(offline, prompt)
        choice = body["choices"][0]
        assert choice["token_ids"] == want.token_ids
        assert choice["prompt_token_ids"] == want.prompt_token_ids
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(want.logprobs, abs=1e-4)
        assert choice["text"] == want.text and choice["finish_reason"] == "length"
        assert body["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
        assert isinstance(body["usage"]["prompt_tokens_details"]["cached_tokens"], int)


def test_a_short_prompt_runs_whole_on_decode_and_equals_the_offline_engine(urls, client, offline):
    """Conditional disaggregation: a prompt of at most DECODE_PREFILL_MAX tokens is prefilled on
    its decode replica (no prefill call, no handoff), a longer one goes through the prefill pool;
    greedy tokens equal the offline engine's either way, and /metrics counts each route."""
    url = urls["disaggregated"]
    routes = lambda: {r: metric_or_0(client.get(f"{url}/metrics").text, f'kvmesh_prefill_route_total{{route="{r}"}}')
                      for r in ("decode_short", "prefill_pool")}      # noqa: E731
    before = routes()
    short, long_ = [5, 17, 300, 42], [5, 17, 300, 42, 99, 7, 11]
    for prompt in (short, long_, short):
        r = client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                       "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == greedy(offline, prompt).token_ids
    after = routes()
    assert (after["decode_short"] - before["decode_short"], after["prefill_pool"] - before["prefill_pool"]) == (2, 1)


@pytest.mark.parametrize("mode", MODES)
def test_streamed_completion_equals_whole_completion(urls, client, mode):
    req = {"prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True}
    whole = client.post(f"{urls[mode]}/v1/completions", json=req).json()["choices"][0]
    events = stream_events(client, f"{urls[mode]}/v1/completions",
                           {**req, "stream_options": {"include_usage": True}})
    chunks, usage = events[:-1], events[-1]
    assert all(e["object"] == "text_completion" for e in events)
    assert "".join(e["choices"][0]["text"] for e in chunks) == whole["text"]
    assert [t for e in chunks for t in e["choices"][0]["token_ids"]] == whole["token_ids"]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == MAX_TOKENS


CHAT = [{"role": "user", "content": "Continue: Blessed is the man who"}]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("thinking", [True, False])
def test_chat_speaks_v4s_format_and_streams_the_same_reply(urls, client, offline, mode, thinking):
    """The built-in model is served in DeepSeek-V4's chat format: the prompt is kvmesh's V4
    encoder's, the greedy reply the offline engine's, split at `</think>` into reasoning_content
    and content with thinking on (the default) and all content with it off; streamed alike."""
    tok = load_tokenizer(default_model_dir())
    req = {"messages": CHAT, "max_tokens": 96, "temperature": 0, "return_token_ids": True,
           **({} if thinking else {"chat_template_kwargs": {"thinking": False}})}
    r = client.post(f"{urls[mode]}/v1/chat/completions", json=req)
    assert r.status_code == 200, r.text
    body = r.json()
    want = greedy(offline, tok.encode_rendered(encode_messages(CHAT, THINKING if thinking else CHAT_MODE)), 96)
    assert body["prompt_token_ids"] == want.prompt_token_ids
    assert body["choices"][0]["token_ids"] == want.token_ids and want.token_ids[-1] == tok.eos_id
    text = tok.decode_markup(want.token_ids)
    reasoning, content = text.split(END_THINK) if thinking else (None, text)
    message = body["choices"][0]["message"]
    assert (message.get("reasoning_content"), message["content"]) == (reasoning, content)
    assert content and (reasoning or not thinking) and body["choices"][0]["finish_reason"] == "stop"
    events = stream_events(client, f"{urls[mode]}/v1/chat/completions", req)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    deltas = [e["choices"][0]["delta"] for e in events]
    assert "".join(d.get("content") or "" for d in deltas) == content
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == (reasoning or "")
    assert [t for e in events[1:] for t in e["choices"][0]["token_ids"]] == want.token_ids


def test_a_required_tool_call_on_the_built_in_model_comes_back_as_tool_calls(urls, client):
    """tool_choice "required" (grammar-constrained) on the tools the built-in model was trained
    with: one schema-valid call, finish_reason "tool_calls", no content."""
    jsonschema = pytest.importorskip("jsonschema")
    req = {"messages": [{"role": "user", "content": "Find two verses about water."}], "tools": TOOLS,
           "tool_choice": "required", "max_tokens": 200, "temperature": 0}
    for thinking in (True, False):
        r = client.post(f"{urls['colocated']}/v1/chat/completions",
                        json={**req, "chat_template_kwargs": {"thinking": thinking}})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"]
        assert bool(choice["message"].get("reasoning_content")) == thinking
        (call,) = choice["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call["function"]["name"]]
        jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


@pytest.mark.parametrize("mode", MODES)
def test_stop_string_ends_the_text_before_it(urls, client, offline, mode):
    full = greedy(offline, "hello world", 40).text
    stop = next(full[i:i + 2] for i in range(1, len(full) - 1) if "\ufffd" not in full[i:i + 2])
    r = client.post(f"{urls[mode]}/v1/completions",
                    json={"prompt": "hello world", "max_tokens": 40, "temperature": 0, "stop": [stop]})
    choice = r.json()["choices"][0]
    assert choice["text"] == full[:full.index(stop)] and choice["finish_reason"] == "stop"
    events = stream_events(client, f"{urls[mode]}/v1/completions",
                           {"prompt": "hello world", "max_tokens": 40, "temperature": 0, "stop": stop})
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]


def test_seeded_sampling_is_reproducible_and_equal_across_modes(urls, client):
    req = {"prompt": "hello world", "max_tokens": 10, "temperature": 0.9, "top_p": 0.9, "seed": 7,
           "return_token_ids": True}
    # decode continues on another engine with a fresh generator, so compare colocated runs
    a = client.post(f"{urls['colocated']}/v1/completions", json=req).json()["choices"][0]["token_ids"]
    b = client.post(f"{urls['colocated']}/v1/completions", json=req).json()["choices"][0]["token_ids"]
    assert a == b and len(a) == 10


def test_openai_client_works_unchanged(urls):
    openai = pytest.importorskip("openai")
    for mode in MODES:
        client = openai.OpenAI(base_url=f"{urls[mode]}/v1", api_key="unused")
        model = client.models.list().data[0].id
        c = client.completions.create(model=model, prompt="hello world", max_tokens=8, temperature=0)
        assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == 8
        streamed = "".join(ch.choices[0].text for ch in client.completions.create(
            model=model, prompt="hello world", max_tokens=8, temperature=0, stream=True) if ch.choices)
        assert streamed == c.choices[0].text
        chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=24, temperature=0)
        deltas = [ch.choices[0].delta for ch in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=24, temperature=0,
            stream=True, stream_options={"include_usage": True}) if ch.choices]
        message = chat.choices[0].message
        assert "".join(d.content or "" for d in deltas) == (message.content or "")
        assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == \
            message.model_extra["reasoning_content"]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=model, prompt="x", max_tokens=-1)


def test_models_health_and_metrics(urls, client):
    for mode in MODES:
        assert client.get(f"{urls[mode]}/health").json()["status"] == "ok"
        models = client.get(f"{urls[mode]}/v1/models").json()
        assert models["object"] == "list" and models["data"][0]["max_model_len"] > 0
        client.post(f"{urls[mode]}/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0})
    text = client.get(f"{urls['disaggregated']}/metrics").text
    for name in ("kvmesh_time_to_first_token_seconds_count", "kvmesh_time_per_output_token_seconds_count",
                 "kvmesh_generated_tokens_per_second", "kvmesh_cached_tokens_total", "kvmesh_queue_depth",
                 "kvmesh_worker_free_blocks", 'kvmesh_handoff_bytes_total{transport="nixl"}'):
        assert name in text, name
    assert metric(text, 'kvmesh_handoff_bytes_total{transport="nixl"}') > 0
    for pool in ("prefill", "decode"):      # Serve's controller's count, starting replicas included
        assert metric(text, f'kvmesh_pool_replicas{{pool="{pool}",state="RUNNING"}}') == 1
    assert 'transport="ray"' not in text and "kvmesh_handoff_fallbacks_total{" not in text


def test_without_nixl_the_handoff_falls_back_to_ray_objects_and_says_so(urls, client):
    r = client.post(f"{urls['fallback']}/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 4})
    assert r.status_code == 200
    text = client.get(f"{urls['fallback']}/metrics").text
    assert metric(text, 'kvmesh_handoff_bytes_total{transport="ray"}') > 0
    assert metric(text, 'kvmesh_handoff_fallbacks_total{reason="nixl_unavailable"}') >= 1
    assert 'transport="nixl"' not in text


def test_with_two_ingress_replicas_every_scrape_reports_every_request(urls, client):
    """Completions spread over the fallback app's two ingress replicas (concurrent, so both take
    some); every later scrape of /metrics, whichever replica answers it, counts all of them."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from ray import serve

    from kvmesh.cluster.serve.metrics import each_replica

    def completed(text: str) -> float:
        name = 'kvmesh_requests_total{endpoint="completions",status="200"} '
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))

    before = completed(client.get(f"{urls['fallback']}/metrics").text)
    n = 12
    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda i: client.post(f"{urls['fallback']}/v1/completions", json={
            "prompt": f"request {i}", "max_tokens": 2, "temperature": 0}).status_code, range(n)))
    assert codes == [200] * n
    scrapes = [client.get(f"{urls['fallback']}/metrics").text for _ in range(20)]
    assert [metric(t, "kvmesh_ingress_replicas_scraped") for t in scrapes] == [INGRESS_REPLICAS] * 20
    assert [completed(t) - before for t in scrapes] == [n] * 20
    own = asyncio.run(each_replica(serve.get_deployment_handle("Ingress", "fallback"), "metric_families",
                                   lambda answer: answer[0]))
    served = {rid: sum(s.value for f in families for s in f.samples if s.name == "kvmesh_requests_total"
                       and s.labels == {"endpoint": "completions", "status": "200"})
              for rid, (_, families) in own.items()}
    assert len(served) == INGRESS_REPLICAS and all(v > 0 for v in served.values()), served   # both took some


def held(app: str) -> int:
    from ray import serve
    return serve.get_deployment_handle("Prefill", app).info.remote().result()["held"]


def test_prefill_releases_the_cache_once_decode_has_read_it_or_after_the_timeout(urls, client):
    from ray import serve

    from kvmesh.cluster.messages import GenRequest
    for _ in range(3):
        client.post(f"{urls['disaggregated']}/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 3})
    deadline = time.monotonic() + 5
    while held("disagg") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert held("disagg") == 0, "decode's READ notification did not release the prefill cache"
    # a handoff nobody decodes (the client went away): released after release_timeout_s
    timeouts = f"{urls['disaggregated']}/metrics", "kvmesh_worker_held_timeouts"
    before = prefill_metric(*timeouts)
    prefill = serve.get_deployment_handle("Prefill", "disagg")
    orphan = prefill.prefill.remote(GenRequest("orphan-1", [5] * 300, SamplingParams(max_tokens=8))).result()
    assert orphan.offer.transport == "nixl" and held("disagg") == 1
    deadline = time.monotonic() + RELEASE_TIMEOUT_S + 10
    while held("disagg") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert held("disagg") == 0
    assert prefill_metric(*timeouts) == before + 1          # the timeout release shows in /metrics


def prefill_metric(url: str, name: str, pool: str = "prefill") -> float:
    """`name` summed over the workers of `pool` in the /metrics at `url`."""
    text = httpx.get(url, timeout=60).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'pool="{pool}"' in line)


def test_a_pd_repeat_moves_only_the_blocks_decode_lacks(urls, client, offline):
    """Issue 30: decode keeps the prompt's blocks in its prefix cache; the repeat's READ moves the
    rest (the partial last block) + the state slot, and the tokens are the same."""
    url, names = urls["disaggregated"], ("nixl_bytes", "handoff_reused_blocks", "handoff_saved_bytes")
    prompt = random_prompt(3 * 128 + 40, seed=30)       # 3 whole blocks of 128 tokens + a partial one
    want = greedy(offline, prompt, 4).token_ids
    seen = [{n: prefill_metric(f"{url}/metrics", f"kvmesh_worker_{n}", "decode") for n in names}]
    for _ in range(2):
        r = client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                                        "return_token_ids": True})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want
        seen.append({n: prefill_metric(f"{url}/metrics", f"kvmesh_worker_{n}", "decode") for n in names})
    first, again = ({n: b[n] - a[n] for n in names} for a, b in zip(seen, seen[1:]))
    assert (first["handoff_reused_blocks"], again["handoff_reused_blocks"]) == (0, 3)
    assert again["handoff_saved_bytes"] == 3 * offline.cache.block_nbytes
    assert again["nixl_bytes"] == first["nixl_bytes"] - again["handoff_saved_bytes"] > 0


SPEC_METRICS = ("kvmesh_worker_handoff_draft_tokens", "kvmesh_worker_draft_tokens",
                "kvmesh_worker_accepted_draft_tokens")


@pytest.mark.parametrize("mode", ["disaggregated", "fallback"])
def test_decode_drafts_from_its_first_step_after_a_handoff_with_colocated_tokens(urls, client, offline, mode):
    """Issue 32: the built-in model's MTP layer drafts by default; its state for the prompt comes
    with the handoff (NIXL, or the Ray-object fallback), so the decode pool drafts from its first
    step, and drafts and accepts exactly as many tokens as the offline (colocated) engine, with the
    same greedy tokens as the colocated app."""
    prompt = random_prompt(200, vocab=2000, seed=32 + len(mode))     # in no cache yet
    req = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
    before = [prefill_metric(f"{urls[mode]}/metrics", name, "decode") for name in SPEC_METRICS]
    offline_before = (offline.counters.draft_tokens, offline.counters.accepted_draft_tokens)
    moved = client.post(f"{urls[mode]}/v1/completions", json=req).json()["choices"][0]["token_ids"]
    want = greedy(offline, prompt, 16)
    handed, drafted, accepted = (prefill_metric(f"{urls[mode]}/metrics", name, "decode") - b
                                 for name, b in zip(SPEC_METRICS, before))
    colocated = client.post(f"{urls['colocated']}/v1/completions", json=req).json()["choices"][0]["token_ids"]
    assert moved == colocated == want.token_ids
    assert handed > 0 and accepted > 0
    assert (drafted, accepted) == (offline.counters.draft_tokens - offline_before[0],
                                   offline.counters.accepted_draft_tokens - offline_before[1])


def test_the_issues_1_4_mb_schema_is_a_400_naming_response_format_and_serving_goes_on(urls, client):
    """Issue 23: 13,000 properties (1.4 MB) once grew a prefill replica to ~20 GB; now it is
    refused before any work, in a second, and the next request is served."""
    schema = {"type": "object", "properties": {f"property_number_{i:05d}": {"type": "string", "description": "x" * 60}
                                               for i in range(13_000)}}
    for mode in MODES:
        start = time.monotonic()
        r = client.post(f"{urls[mode]}/v1/completions", json={"prompt": "hi", "max_tokens": 4, "response_format": {
            "type": "json_schema", "json_schema": {"name": "big", "schema": schema}}})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "response_format" and "max_schema_bytes" in err["message"]
        assert time.monotonic() - start < 10
        assert client.post(f"{urls[mode]}/v1/completions", json={"prompt": "hi", "max_tokens": 4}).status_code == 200


def metric_or_0(text: str, name: str) -> float:
    values = [float(l.split()[-1]) for l in text.splitlines() if l.startswith(name + " ")]
    return values[0] if values else 0.0


def metric(text: str, name: str) -> float:
    values = [float(l.split()[-1]) for l in text.splitlines() if l.startswith(name + " ")]
    assert values, f"{name} not in metrics"
    return values[0]


# ---- bad input: always a 4xx with OpenAI's error body, never a 5xx --------------------------
BAD_COMPLETIONS = [
    b"{not json",
    b"[1, 2]",
    b'{"prompt": "hi", "max_tokens": "3"}',
    b'{"prompt": "hi", "max_tokens": -1}',
    b'{"prompt": "hi", "max_tokens": 0}',
    b'{"prompt": "hi", "max_tokens": 100000000}',
    b'{"prompt": "hi", "temperature": "hot"}',
    b'{"prompt": "hi", "temperature": -1}',
    b'{"prompt": "hi", "top_p": 0}',
    b'{"prompt": "hi", "frobnicate": true}',
    b'{"prompt": ""}',
    b'{"prompt": []}',
    b'{"prompt": [1, "a"]}',
    b'{"prompt": [-1]}',
    b'{"prompt": [100000]}',
    b'{"prompt": 12}',
    b'{"max_tokens": 3}',
    b'{"prompt": "hi", "n": 0}',
    b'{"prompt": "hi", "suffix": "x"}',
    b'{"prompt": "hi", "best_of": 1, "n": 2}',
    b'{"prompt": "hi", "logit_bias": {"x": 1}}',
    b'{"prompt": "hi", "response_format": {"type": "json_schema"}}',
    b'{"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}',
    b'{"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}',
    b'{"prompt": "hi", "min_tokens": 9, "max_tokens": 3}',
    b'{"prompt": "hi", "stream": "yes"}',
    b'{"prompt": "hi", "seed": 1.5}',
    b'{"prompt": "hi", "logprobs": 99}',
    b'{"prompt": "hi", "model": "other-model"}',
]
BAD_CHAT = [
    b'{"messages": []}',
    b'{"messages": "hi"}',
    b'{"messages": [{"role": "wizard", "content": "hi"}]}',
    b'{"messages": [{"role": "user", "content": "hi", "mood": "sad"}]}',
    b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -5}',
    b'{"prompt": "hi"}',
    b'{"messages": [{"role": "user", "content": "hi"}], "tools": []}',
    b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}',
]


@pytest.mark.parametrize("body", BAD_COMPLETIONS + [("chat", b) for b in BAD_CHAT], ids=repr)
def test_bad_input_is_a_4xx_with_an_openai_error_body(urls, client, body):
    path = "/v1/completions"
    if isinstance(body, tuple):
        path, body = "/v1/chat/completions", body[1]
    for stream in (False, True):
        raw = body
        if stream and body.startswith(b"{") and body.endswith(b"}") and b'"stream"' not in body:
            raw = body[:-1] + b', "stream": true}'
        r = client.post(urls["disaggregated"] + path, content=raw, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (raw, r.status_code, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]


def test_over_long_prompt_is_400_naming_the_limit(urls, client):
    limit = client.get(f"{urls['colocated']}/v1/models").json()["data"][0]["max_model_len"]
    for mode in MODES:
        r = client.post(f"{urls[mode]}/v1/completions", json={"prompt": [7] * (limit + 1), "max_tokens": 1})
        assert r.status_code == 400 and str(limit) in r.json()["error"]["message"]


def test_unknown_route_and_wrong_method_use_the_error_body(urls, client):
    r = client.get(f"{urls['disaggregated']}/v1/nope")
    assert r.status_code == 404 and "error" in r.json()
    r = client.get(f"{urls['disaggregated']}/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
