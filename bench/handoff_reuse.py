"""Decode-side reuse in P/D: what a handoff moves when the decode engine already holds the prompt.

Two engines on the built-in model, each with its own NIXL agent (UCX over loopback on CPU), as a
prefill and a decode worker. Per prompt size: a first turn handed off to the decode engine, then the
next turn, the same prompt + a short question (`--extra` tokens), handed off to the same decode
engine, which holds the first turn's blocks and READs only the rest + the slot; the baseline is the
full handoff of that next turn to a decode engine that lacks it (every block + the slot). Reported
per handoff: bytes READ, the READ's seconds, and add-request-to-first-decode-token on the decode
engine (admission, READ and the first step). Greedy tokens: reuse equals the full handoff.

    python bench/handoff_reuse.py                     # 2K and 8K tokens
    python bench/handoff_reuse.py --sizes 1024 --repeats 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvmesh.workers.engine import Engine, EngineConfig  # noqa: E402
from kvmesh.workers.request import Resume  # noqa: E402
from kvmesh.workers.sampling.params import SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def run(engine: Engine) -> list:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def hand_over(prefill: Engine, source, decode: Engine, sink, rid: str, prompt: list[int]):
    """(tokens, report, seconds from add_request on decode to its first new token)."""
    prefill.add_request(rid, prompt, GREEDY, hold_kv=True)
    first = [o for o in run(prefill) if o.request_id == rid][-1]
    offer = prefill.offer_held(rid, source)
    reports = []

    def load(cache, blocks, slot, reused):
        reports.append(sink.load(offer, cache, blocks, slot, reused))
    start = time.perf_counter()
    decode.add_request(rid, prompt, GREEDY, resume=Resume(first.first, load, first.cached_tokens))
    out, to_first = [], None
    while decode.has_unfinished():
        step = decode.step()
        if to_first is None and any(o.new_token_ids for o in step):
            to_first = time.perf_counter() - start
        out += step
    prefill.release_read(source)
    prefill.release_held(rid)
    return [o for o in out if o.finished][-1].token_ids, reports[0], to_first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="2048,8192", help="prompt tokens, comma-separated")
    ap.add_argument("--extra", type=int, default=40, help="tokens the next turn adds")
    ap.add_argument("--repeats", type=int, default=3, help="rounds per size (medians)")
    args = ap.parse_args()
    config = EngineConfig(kv_cache_bytes=512 << 20, max_batched_tokens=2048)
    engines = [Engine(config) for _ in range(3)]     # prefill, decode, a fresh decode for the full-handoff check
    transports = [e.open_nixl(f"bench-handoff-{i}", "127.0.0.1", "UCX", 30.0) for i, e in enumerate(engines)]
    if any(t is None for t in transports):
        sys.exit("NIXL (UCX) is needed")
    (prefill, decode, fresh), (source, sink, fresh_sink) = engines, transports
    vocab = prefill.args.vocab_size
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        full, reused = [], []
        for r in range(args.repeats):
            base = [(size * 7 + r * 131 + i * 17) % (vocab - 3) + 3 for i in range(size)]
            turn = base + [(i * 29 + r) % (vocab - 3) + 3 for i in range(args.extra)]
            hand_over(prefill, source, decode, sink, f"a{size}-{r}", base)        # the first turn
            tokens, rep, t = hand_over(prefill, source, decode, sink, f"b{size}-{r}", turn)
            reused.append((rep.nbytes, rep.seconds, t, rep.reused_blocks))
            want, rep, t = hand_over(prefill, source, fresh, fresh_sink, f"c{size}-{r}", turn)
            full.append((rep.nbytes, rep.seconds, t, rep.reused_blocks))
            assert tokens == want, f"size {size}: reuse changed the tokens"
        for name, got in (("full (decode lacks it)", full), ("reuse (decode holds turn 1)", reused)):
            rows.append((size, name, *(statistics.median(x[k] for x in got) for k in range(4))))
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"\nDecode-side reuse, built-in model, NIXL UCX loopback on CPU; medians of {args.repeats} rounds; "
          f"the next turn = prompt + {args.extra} tokens; load average {load} (1, 5, 15 min); greedy tokens equal "
          f"a full handoff's\n")
    print("| turn-1 tokens | next turn's handoff | blocks reused | MB READ | READ ms | to first decode token ms "
          "| MB vs full |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for i, (size, name, nbytes, seconds, to_first, blocks) in enumerate(rows):
        base = rows[i - i % 2][2]
        print(f"| {size} | {name} | {blocks:.0f} | {nbytes / 1e6:.2f} | {seconds * 1e3:.2f} | {to_first * 1e3:.1f} | "
              f"{nbytes / base:.3f}x |")
    for t in transports:
        t.close()
    for e in engines:
        e.close()


if __name__ == "__main__":
    main()
