"""Where the time of a forced tool call goes: a chat completion with `tools` and `tool_choice`
naming a function, on the built-in default model with `kvmesh serve`'s engine defaults
(EngineConfig(): speculative_tokens=auto, so a lone request drafts with the MTP layer), built
the way the ingress builds it and run in-process on the synchronous Engine (no Serve app).

    python bench/tool_call.py [--requests 5] [--max-tokens N] [--mode thinking,chat,auto] [--fresh-tools]

Per request (a fresh seed each; the first also pays the grammar's first compile):
  * ingress: the tool grammar's text (ChatCompletionRequest.guide -> dsv4_grammar) and the
    prompt (chat_prompt_ids, V4's encoder), then gen_request (validation, max_tokens)
  * compile: the guide's compile in the engine's pool, or a cache hit (GuideCompiler stats)
  * tokens generated, engine steps, finish reason, time in the engine's steps
  * mask: time filling and applying grammar masks (sampler._mask_grammar, and the draft rows'
    fills, OutputProcessor._draft_bitmask; on a checkout before issue 49: Guide.allowed, the
    fill and the unpacking to bool [V], its masked_fill not counted)
  * parse: feeding the output to the reply parser token by token, as a stream is
    (responses.Choice: detokenizer + dsv4_parse)
Without --max-tokens the request leaves max_tokens unset (the OpenAI default): the ingress
then allows what fits in the context. Modes: thinking (V4's default), chat
(reasoning_effort none), auto (the same tools with tool_choice auto: no grammar, the per-token
baseline). --fresh-tools: each request's tool description differs, so each compiles anew.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import kvmesh  # noqa: E402
from kvmesh.cluster.chat.template import chat_prompt_ids  # noqa: E402
from kvmesh.cluster.messages import Chunk  # noqa: E402
from kvmesh.cluster.openai.limits import Limits  # noqa: E402
from kvmesh.cluster.openai.protocol import ChatCompletionRequest  # noqa: E402
from kvmesh.cluster.openai.responses import Choice, ReplyFormat  # noqa: E402
from kvmesh.cluster.openai.serving import stop_ids  # noqa: E402
from kvmesh.cluster.openai.validate import Prompts, gen_request  # noqa: E402
from kvmesh.workers.engine import Engine  # noqa: E402
from kvmesh.workers.engine.output import OutputProcessor  # noqa: E402
from kvmesh.workers.engine_config import EngineConfig  # noqa: E402
from kvmesh.workers.sampling import grammar, sampler  # noqa: E402
from tests.helpers import ASK, TOOLS  # noqa: E402


class Clock:
    """Seconds spent in the wrapped callables since the last reset."""

    def __init__(self):
        self.spent = 0.0

    def wrap(self, owner, name: str) -> None:
        fn = getattr(owner, name)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.spent += time.perf_counter() - t
        static = isinstance(owner.__dict__.get(name), staticmethod) if isinstance(owner, type) else False
        setattr(owner, name, staticmethod(timed) if static else timed)


def one(engine: Engine, mask: Clock, body: dict, seed: int, rid: str, fresh: bool) -> dict:
    t0 = time.perf_counter()
    if fresh:
        tools = [{**t, "function": {**t["function"], "description": f"{rid}: {t['function'].get('description', '')}"}}
                 for t in body["tools"]]
        body = {**body, "tools": tools}
    req = ChatCompletionRequest(**{**body, "seed": seed})
    t = time.perf_counter()
    guide = req.guide
    t_grammar_text = time.perf_counter() - t
    tok = engine.tokenizer
    ids = chat_prompt_ids(tok, req)
    fmt = ReplyFormat(req.thinking_mode, bool(req.offered_tools), req.parallel_tool_calls, False)
    prompts = Prompts([ids], req.token_limit, req.logprobs, field="messages", fmt=fmt)
    limits = Limits(engine.max_model_len, engine.args.vocab_size, engine.config.max_schema_bytes)
    gen = gen_request(req, prompts, ids, rid, limits)
    t_ingress = time.perf_counter() - t0

    before = engine.guides.stats()
    t = time.perf_counter()
    engine.add_request(rid, gen.prompt, gen.params)        # waits for the compile (or takes it from the cache)
    t_compile = time.perf_counter() - t
    after = engine.guides.stats()
    mask.spent = 0.0
    counters = engine.counters
    steps0, drafted0, accepted0 = counters.steps, counters.draft_tokens, counters.accepted_draft_tokens
    outs, t = [], time.perf_counter()
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid]
    t_decode = time.perf_counter() - t
    final = outs[-1]
    choice = Choice(0, tok, [], stop_ids=stop_ids(tok, req), fmt=fmt)
    t = time.perf_counter()
    for o in outs:
        choice.feed(Chunk(o.new_token_ids, o.logprobs[len(o.logprobs) - len(o.new_token_ids):], o.finished,
                          o.finish_reason, len(ids), 0))
    t_parse = time.perf_counter() - t
    return dict(prompt=len(ids), tokens=len(final.token_ids), finish=choice.finish_reason or final.finish_reason,
                steps=counters.steps - steps0, drafted=counters.draft_tokens - drafted0,
                accepted=counters.accepted_draft_tokens - accepted0, max_tokens=gen.params.max_tokens,
                grammar_text=t_grammar_text, ingress=t_ingress, compile=t_compile,
                compiled=after.compiles - before.compiles, hits=after.cache_hits - before.cache_hits,
                decode=t_decode, mask=mask.spent, parse=t_parse, total=t_ingress + t_compile + t_decode + t_parse,
                reasoning=len(choice.reasoning), calls=len(choice.calls),
                guide_bytes=len(guide[1]) if guide else 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--mode", default="thinking,chat,auto", help="thinking (the API's default), chat, auto")
    parser.add_argument("--fresh-tools", action="store_true", help="a different tool description per request")
    parser.add_argument("--temperature", type=float, default=None, help="default: unset (the API's 1.0)")
    args = parser.parse_args(argv)
    engine = Engine(EngineConfig())
    mask = Clock()
    if hasattr(sampler, "_mask_grammar"):
        mask.wrap(sampler, "_mask_grammar")       # fill + apply, every sampler call
        if hasattr(OutputProcessor, "_draft_bitmask"):
            mask.wrap(OutputProcessor, "_draft_bitmask")     # a speculative step's draft rows, filled up front
    else:
        mask.wrap(grammar.Guide, "allowed")       # before issue 49: fill + unpack (its masked_fill not counted)
    print(f"kvmesh from {os.path.dirname(kvmesh.__file__)}; engine defaults (speculative {engine.config.speculative_tokens!r}, "
          f"max_model_len {engine.max_model_len}); load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}\n")
    cols = ("mode", "seed", "prompt", "max_tokens", "tokens", "finish", "steps", "drafts acc/made", "grammar text ms",
            "ingress ms", "compile ms (new/hit)", "engine s", "ms/token", "mask ms", "parse ms", "reasoning chars",
            "calls")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---:|" * len(cols))
    rows = []
    for mode in args.mode.split(","):
        forced = {"type": "function", "function": {"name": "get_weather"}}
        body = dict(messages=ASK, tools=TOOLS, tool_choice="auto" if mode == "auto" else forced)
        if args.max_tokens:
            body["max_tokens"] = args.max_tokens
        if args.temperature is not None:
            body["temperature"] = args.temperature
        if mode == "chat":
            body["reasoning_effort"] = "none"
        for seed in range(args.requests):
            r = one(engine, mask, body, seed, f"{mode}-{seed}", args.fresh_tools)
            rows.append((mode, r))
            print(f"| {mode} | {seed} | {r['prompt']} | {r['max_tokens']} | {r['tokens']} | {r['finish']} | {r['steps']} "
                  f"| {r['accepted']}/{r['drafted']} | {r['grammar_text'] * 1e3:.1f} | {r['ingress'] * 1e3:.1f} "
                  f"| {r['compile'] * 1e3:.0f} ({r['compiled']}/{r['hits']}) | {r['decode']:.2f} "
                  f"| {r['decode'] * 1e3 / max(r['tokens'], 1):.1f} | {r['mask'] * 1e3:.1f} | {r['parse'] * 1e3:.1f} "
                  f"| {r['reasoning']} | {r['calls']} |", flush=True)
    for mode in args.mode.split(","):
        rs = [r for m, r in rows if m == mode]
        med = {k: statistics.median(r[k] for r in rs) for k in ("tokens", "decode", "mask", "parse", "total")}
        print(f"\n{mode}: median tokens {med['tokens']:.0f}, engine {med['decode']:.2f} s, mask {med['mask'] * 1e3:.1f} ms, "
              f"parse {med['parse'] * 1e3:.1f} ms, total {med['total']:.2f} s")
    print(f"\nload average {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
