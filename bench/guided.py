"""Guided decoding: what grammar masks cost a decode step.

    python bench/guided.py [--batch 32] [--guided 0,8,32] [--max-tokens 48] [--repeats 3]
                           [--speculative K] [--vocabs 2060,129280]

1. The engine (the built-in default model, fp32, greedy, EOS ignored): a decode batch of
   --batch requests, --guided of them under a JSON schema (an array of 64 digits, so no guided
   request can end inside --max-tokens and the batch stays whole), the others free. Per level:
   the median and fastest decode step while the whole batch decodes, the median step in CPU time
   (time.thread_time), and the median time of the step's sampling call (OutputProcessor.sample /
   .speculated: grammar masks and sampling, the model excluded). The levels alternate inside
   each round so that a burst of other load hits every level alike; the table shows medians of
   --repeats rounds. --speculative K drafts K tokens per step with the checkpoint's MTP layer
   (default 0: plain decoding, what speculative_tokens=auto gives a batch of 32).
2. The sampler alone: sample_batch on random logits [--batch, V] for each V of --vocabs (2060:
   the default model; 129280: DeepSeek-V4's vocabulary, the default model's tokenizer padded to
   it), --guided rows masked by their grammar, as the engine calls it per step (the masks filled
   from each row's matcher included); the median of 200 calls.

The same file runs on an older checkout (copy it and bench/tool_call.py there): before issue 49 each guided row's mask
was a bool [V] unpacked on the host (Guide.allowed) and applied row by row; the script detects
which sampler it runs against and says so. Prints the load average beside the tables.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import kvmesh  # noqa: E402
from kvmesh.workers.checkpoint.default_model import ensure_default_model  # noqa: E402
from kvmesh.workers.engine import Engine  # noqa: E402
from kvmesh.workers.engine_config import EngineConfig  # noqa: E402
from kvmesh.workers.sampling import sampler  # noqa: E402
from kvmesh.workers.sampling.grammar import GuideCompiler  # noqa: E402
from kvmesh.workers.sampling.params import SamplingParams  # noqa: E402
from bench.tool_call import Clock  # noqa: E402

FIRST_TOKEN_ID = 3
PROMPT_LEN = 32
SCHEMA = json.dumps({"type": "object", "additionalProperties": False, "required": ["digits"], "properties": {
    "digits": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
               "minItems": 64, "maxItems": 64}}})
OLD_SAMPLER = "allowed" in sampler.SampleRow.__dataclass_fields__     # the bool [V] per-row path


def load() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(FIRST_TOKEN_ID, vocab, (PROMPT_LEN,), generator=g).tolist() for _ in range(n)]


def timed_sampling(engine: Engine) -> Clock:
    """A clock over the engine's sampling calls (OutputProcessor.sample / .speculated)."""
    clock = Clock()
    for name in ("sample", "speculated"):
        clock.wrap(engine.outputs, name)
    return clock


def run(engine: Engine, timer: Clock, batch: int, guided: int, max_tokens: int, seed: int) -> dict:
    """One batch: `guided` of `batch` requests under SCHEMA; step times while all decode."""
    free = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    schema = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, guide=("json_schema", SCHEMA))
    ps = prompts(batch, engine.args.vocab_size, seed)
    ids = [f"g{seed}-{i}" for i in range(batch)]
    for i, (rid, p) in enumerate(zip(ids, ps)):
        engine.add_request(rid, p, schema if i < guided else free)
    started: set[str] = set()
    steps, cpu, sampling, finished_early = [], [], [], 0
    while engine.has_unfinished():
        timer.spent = 0.0
        t, c = time.perf_counter(), time.thread_time()
        outs = engine.step()
        wall, cpu_s = time.perf_counter() - t, time.thread_time() - c
        if len(outs) == batch and started >= set(ids):
            steps.append(wall)
            cpu.append(cpu_s)
            sampling.append(timer.spent)
        for o in outs:
            started.add(o.request_id)
            if o.finished and len(o.token_ids) < max_tokens:
                finished_early += 1
    assert finished_early == 0, "a request ended before max_tokens: the batch did not stay whole"
    return dict(step=statistics.median(steps), fastest=min(steps), cpu=statistics.median(cpu),
                sampling=statistics.median(sampling), steps=len(steps))


def engine_table(args, levels: list[int]) -> list[str]:
    model = ensure_default_model()
    engine = Engine(EngineConfig(model=str(model), dtype="float32", max_num_seqs=args.batch,
                                 kv_cache_bytes=1 << 30, prefix_reuse=False, speculative_tokens=0))
    if args.speculative:
        from kvmesh.workers.spec.mtp import MTPDrafter
        engine.set_drafter(MTPDrafter(engine.model, engine.slots.num_slots), args.speculative)
    engine.guides.compile(("json_schema", SCHEMA))          # compiled once, before any timing
    timer = timed_sampling(engine)
    run(engine, timer, args.batch, max(levels), args.max_tokens, seed=1)      # warm-up
    results: dict[int, list[dict]] = {g: [] for g in levels}
    for r in range(args.repeats):
        for i in range(len(levels)):
            g = levels[(i + r) % len(levels)]
            results[g].append(run(engine, timer, args.batch, g, args.max_tokens, seed=100 * r + g + 2))
        print(f"engine round {r} done (load {load()})", file=sys.stderr)
    engine.close()
    med = {g: {k: statistics.median(x[k] for x in xs) for k in xs[0]} for g, xs in results.items()}
    base = med[levels[0]]
    lines = [f"| guided rows of {args.batch} | median step ms | fastest step ms | median step CPU ms "
             f"| sampling ms / step | step vs {levels[0]} guided |", "|---:|---:|---:|---:|---:|---:|"]
    for g in levels:
        m = med[g]
        lines.append(f"| {g} | {m['step'] * 1e3:.2f} | {m['fastest'] * 1e3:.2f} | {m['cpu'] * 1e3:.2f} "
                     f"| {m['sampling'] * 1e3:.2f} | {m['step'] / base['step']:.2f}x |")
    return lines


def sampler_table(args, levels: list[int], vocabs: list[int]) -> list[str]:
    from kvmesh.workers.checkpoint.tokenizer import load_tokenizer
    model = ensure_default_model()
    tok = load_tokenizer(model)
    lines = [f"| vocab | guided rows of {args.batch} | sampler µs / step (median of 200) |", "|---:|---:|---:|"]
    for vocab in vocabs:
        compiler = GuideCompiler(tok, vocab, [1])
        grammar = compiler.compile(("json_schema", SCHEMA))
        logits = torch.randn(args.batch, vocab, generator=torch.Generator().manual_seed(vocab))
        start = tok.encode('{"digits": [1, 2')
        for g in levels:
            from kvmesh.workers.sampling.grammar import Guide
            guides = [Guide(grammar, vocab) for _ in range(g)]
            for guide in guides:
                for t in start:
                    guide.accept(t)
            params = SamplingParams(temperature=0.0)

            def step():
                if OLD_SAMPLER:
                    rows = [sampler.SampleRow(params, allowed=guides[i].allowed() if i < g else None)
                            for i in range(args.batch)]
                else:
                    rows = [sampler.SampleRow(params, guide=guides[i] if i < g else None) for i in range(args.batch)]
                return sampler.sample_batch(logits, rows)
            for _ in range(20):
                step()
            times = []
            for _ in range(200):
                t = time.perf_counter()
                step()
                times.append(time.perf_counter() - t)
            lines.append(f"| {vocab:,} | {g} | {statistics.median(times) * 1e6:,.0f} |")
        compiler.close()
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--guided", default="0,8,32", help="comma-separated guided rows per batch")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--speculative", type=int, default=0, metavar="K", help="MTP drafts per step (engine table)")
    parser.add_argument("--vocabs", default="2060,129280", help="the sampler table's vocabulary sizes ('' skips it)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    levels = [int(g) for g in args.guided.split(",")]
    code = "bool [V] per row (before issue 49)" if OLD_SAMPLER else "one packed bitmask per step"
    print(f"kvmesh from {os.path.dirname(kvmesh.__file__)}; grammar masks: {code}; torch threads "
          f"{torch.get_num_threads()}; load average at start {load()}")
    lines = engine_table(args, levels)
    print(f"\nengine: default model, fp32, decode batch {args.batch}, prompt {PROMPT_LEN}, max_tokens "
          f"{args.max_tokens}, greedy, speculative k={args.speculative}, medians of {args.repeats} rounds; "
          f"load average (1, 5, 15 min) {load()}\n")
    print("\n".join(lines))
    if args.vocabs:
        lines = sampler_table(args, levels, [int(v) for v in args.vocabs.split(",")])
        print(f"\nsampler alone: logits [{args.batch}, V], greedy; load average (1, 5, 15 min) {load()}\n")
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
