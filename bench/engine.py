"""kvmesh engine vs transformers' generate: decode throughput, time to first token, step time.

    python bench/engine.py [--concurrency 1,8,32,64] [--max-tokens 32] [--prompt-len 128]
                           [--out bench/out/engine.json]

Both run the same checkpoint (the built-in default model unless --model), in fp32, on the
same prompts (random token ids, distinct for every request of every run so no prefix is
reused), greedy, with EOS ignored so every request generates exactly max_tokens. kvmesh
decodes plainly here (speculative_tokens=0; the default drafts with the built-in model's MTP
layer, which --speculative measures).

At concurrency c, all c requests arrive at t0:
  * kvmesh gets them all at once (continuous batching, chunked prefill), stepped with the
    synchronous Engine; a token's time is when the step that produced it returns.
  * transformers serves them one at a time with `generate` (batch 1, its own KV cache), a
    streamer stamping each token ("ref").
  * transformers also serves all c at once with one batched `generate` (a static batch:
    the prompts have equal length, so no padding; its own KV cache), a streamer stamping
    each step ("batched ref"): the strongest plain baseline.

Definitions (all times from time.perf_counter):
  * TTFT (mean over requests):
      kvmesh      first-token time - t0
      ref own     first-token time - start of that request's own generate() (no queueing)
      ref queued  first-token time - t0 (what a client sees when c requests arrive together)
  * decode tok/s:
      kvmesh      tokens produced after the last request's first token / (t_end - that time):
                  the steady state with all c requests decoding
      ref         sum over requests of (max_tokens - 1) / sum of (t_end - t_first)
      batched ref c * (max_tokens - 1) / (t_last_token - t_first_token)
  * decode step ms: kvmesh's median and fastest engine step while all c requests decode (one
    token each), and batched ref's median and fastest step (between consecutive tokens); the
    fastest is the least disturbed by other load, so "fastest-step ratio" (batched ref's
    fastest step / kvmesh's) is the load-robust decode speed ratio, and kvmesh's fastest step
    over c shows how flat the step is
  * CPU time (time.thread_time of the one thread both run on): kvmesh's median decode step and
    batched ref's median step between tokens, and decode tokens per CPU-second of each; on a
    shared machine a busy neighbour stretches wall time but hardly CPU time, so "decode ratio
    vs batched, CPU time" is the other load-robust speed ratio
  * end-to-end tok/s: all generated tokens / wall time from t0 to the last token
  * ratio: kvmesh / reference

With --tensor-parallel-size 1,2 (optionally --enable-expert-parallel) the comparison is
instead kvmesh against itself at each size, in one run, same prompts: TTFT, decode tok/s,
end-to-end tok/s and the decode step, and where rank 0's step time goes: inside the model's
collectives (all-reduce per sublayer, embedding all-reduce, logits all-gather; waiting for the
slowest rank included), sending each step's message to the other ranks, and the rest
(compute). Ranks > 0 are local processes with --threads intra-op threads each.

With --data-parallel-size N the comparison is instead one process vs TP=N+EP vs DP=N+EP
(data-parallel attention), in one run: see bench/data_parallel.py.

With --speculative K the comparison is instead kvmesh against itself with the checkpoint's MTP
layer drafting k = 0, 1, .., K tokens per step, alternated within each round, at each
--concurrency (e.g. `--speculative 3 --concurrency 1,8,32 --max-tokens 64`), on English
openings whose continuation is the model's own text: decode and end-to-end tok/s and their
ratio to k = 0, acceptance, drafts and tokens per drafted step, greedy tokens equal to k = 0.

With --quantized the comparison is instead kvmesh against itself on one released-format
checkpoint (FP8 block-scaled linears, FP4 experts, ~96M parameters, generated here): as
shipped (weights kept quantized, dequantized just in time) vs the same weights dequantized to
a bf16 checkpoint, both bf16 compute, same prompts; plus resident weight bytes of each.

A warm-up run of both (own prompts) comes first. Each concurrency level is run --repeats
times on fresh prompts and the table shows each metric's median (single runs on a shared
machine are noisy); the kvmesh runs are checked to have reused no cached prefix and to
have preempted nothing. All use --threads intra-op threads (default 1). The greedy tokens
of kvmesh are compared with both references request by request as a sanity check (invariant 1), and the table
says how many matched. Writes the raw numbers to --out and a plot of throughput vs
concurrency next to it (.png).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kvmesh.workers.checkpoint.default_model import ensure_default_model  # noqa: E402
from kvmesh.workers.engine import Engine
from kvmesh.workers.engine_config import EngineConfig  # noqa: E402
from kvmesh.workers.sampling.params import SamplingParams  # noqa: E402

FIRST_TOKEN_ID = 3          # ids below are bos / eos / pad in the default model
WARMUP_SEED = 10_000
KV_CACHE_BYTES = 1 << 30


@dataclass
class RunResult:
    system: str
    concurrency: int
    generated_tokens: int
    wall_s: float
    ttft_mean_s: float
    decode_tok_s: float
    e2e_tok_s: float
    ttft_own_mean_s: float | None = None    # reference only: without queueing
    cached_tokens: int = 0                   # kvmesh only: must be 0 (no prefix reuse)
    preemptions: int = 0                     # kvmesh only
    step_ms: float | None = None             # kvmesh and batched ref: median decode step
    step_min_ms: float | None = None         # kvmesh and batched ref: fastest decode step (least disturbed by load)
    decode_cpu_tok_s: float | None = None    # kvmesh and batched ref: decode tokens per second of this thread's CPU time
    step_cpu_ms: float | None = None         # kvmesh and batched ref: median decode step in CPU time


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(FIRST_TOKEN_ID, vocab, (length,), generator=g).tolist() for _ in range(n)]


# ---- kvmesh ------------------------------------------------------------------------------------
def preemptions(engine) -> int:
    """The engine's preemptions so far (a data-parallel engine: all ranks', as of its last step)."""
    return engine.stats().preemptions


def run_kvmesh(engine: Engine, prompts: list[list[int]], max_tokens: int, on_step=None
               ) -> tuple[RunResult, list[list[int]]]:
    """`on_step`: called after every step (e.g. to sample the KV in use)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    preempted_before = preemptions(engine)
    t0 = time.perf_counter()
    ids = [f"bench-{t0}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    stamps: dict[str, list[float]] = {rid: [] for rid in ids}
    final, decode_steps, decode_cpu, decode_cpu_tokens = {}, [], [], 0
    while engine.has_unfinished():
        before, cpu_before = time.perf_counter(), time.thread_time()
        outputs = engine.step()
        now = time.perf_counter()
        if on_step is not None:
            on_step()
        if len(outputs) == len(prompts) and all(stamps[o.request_id] for o in outputs):
            decode_steps.append(now - before)
            decode_cpu.append(time.thread_time() - cpu_before)
            decode_cpu_tokens += sum(len(o.new_token_ids) for o in outputs)    # > 1 each with drafts
        for out in outputs:
            stamps[out.request_id] += [now] * len(out.new_token_ids)
            if out.finished:
                final[out.request_id] = out
    t_end = time.perf_counter()
    firsts = [s[0] for s in stamps.values()]
    last_first = max(firsts)
    after = sum(1 for s in stamps.values() for t in s if t > last_first)
    total = sum(len(s) for s in stamps.values())
    result = RunResult(
        "kvmesh", len(prompts), total, t_end - t0,
        ttft_mean_s=statistics.mean(f - t0 for f in firsts),
        decode_tok_s=after / (t_end - last_first) if t_end > last_first else float("nan"),
        e2e_tok_s=total / (t_end - t0),
        cached_tokens=sum(final[r].cached_tokens for r in ids),
        preemptions=preemptions(engine) - preempted_before,
        step_ms=statistics.median(decode_steps) * 1e3 if decode_steps else None,
        step_min_ms=min(decode_steps) * 1e3 if decode_steps else None,
        decode_cpu_tok_s=decode_cpu_tokens / sum(decode_cpu) if decode_cpu else None,
        step_cpu_ms=statistics.median(decode_cpu) * 1e3 if decode_cpu else None)
    return result, [final[r].token_ids for r in ids]


# ---- transformers ----------------------------------------------------------------------------------
class TimingStreamer:
    """generate() calls put() with the prompt once, then with each new token."""

    def __init__(self) -> None:
        self.calls: list[float] = []
        self.cpu: list[float] = []          # this thread's CPU time at each call (generate runs here)

    def put(self, value) -> None:
        self.calls.append(time.perf_counter())
        self.cpu.append(time.thread_time())

    def end(self) -> None:
        pass

    @property
    def token_times(self) -> list[float]:
        return self.calls[1:]


def run_reference(model, prompts: list[list[int]], max_tokens: int) -> tuple[RunResult, list[list[int]]]:
    t0 = time.perf_counter()
    tokens, own_ttft, queued_ttft, decode_s = [], [], [], []
    for prompt in prompts:
        streamer = TimingStreamer()
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0, streamer=streamer)
        times = streamer.token_times
        assert len(times) == max_tokens, f"reference produced {len(times)} tokens, expected {max_tokens}"
        tokens.append(out[0, len(prompt):].tolist())
        own_ttft.append(times[0] - start)
        queued_ttft.append(times[0] - t0)
        decode_s.append(times[-1] - times[0])
    wall = time.perf_counter() - t0
    total = max_tokens * len(prompts)
    result = RunResult(
        "transformers", len(prompts), total, wall,
        ttft_mean_s=statistics.mean(queued_ttft),
        decode_tok_s=(max_tokens - 1) * len(prompts) / sum(decode_s) if sum(decode_s) > 0 else float("nan"),
        e2e_tok_s=total / wall,
        ttft_own_mean_s=statistics.mean(own_ttft))
    return result, tokens


def run_reference_batched(model, prompts: list[list[int]], max_tokens: int) -> tuple[RunResult, list[list[int]]]:
    """All prompts in one `generate` call (equal lengths: a static batch without padding)."""
    assert len({len(p) for p in prompts}) == 1, "the batched reference needs equal-length prompts"
    streamer = TimingStreamer()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(torch.tensor(prompts), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0, streamer=streamer)
    times = streamer.token_times
    assert len(times) == max_tokens, f"batched reference produced {len(times)} steps, expected {max_tokens}"
    n = len(prompts)
    cpu = streamer.cpu[1:]
    cpu_steps = [b - a for a, b in zip(cpu, cpu[1:])]
    result = RunResult(
        "transformers-batched", n, max_tokens * n, times[-1] - t0, ttft_mean_s=times[0] - t0,
        decode_tok_s=(max_tokens - 1) * n / (times[-1] - times[0]) if times[-1] > times[0] else float("nan"),
        e2e_tok_s=max_tokens * n / (times[-1] - t0),
        step_ms=statistics.median(b - a for a, b in zip(times, times[1:])) * 1e3,
        step_min_ms=min(b - a for a, b in zip(times, times[1:])) * 1e3,
        decode_cpu_tok_s=(max_tokens - 1) * n / sum(cpu_steps) if sum(cpu_steps) > 0 else None,
        step_cpu_ms=statistics.median(cpu_steps) * 1e3)
    return result, [row[len(prompts[0]):].tolist() for row in out]


def median_run(runs: list[RunResult]) -> RunResult:
    """Each metric's median over repeated runs (a shared machine makes single runs noisy)."""
    def med(name):
        values = [getattr(r, name) for r in runs]
        return None if values[0] is None else statistics.median(values)
    first = runs[0]
    return RunResult(first.system, first.concurrency, first.generated_tokens, med("wall_s"), med("ttft_mean_s"),
                     med("decode_tok_s"), med("e2e_tok_s"), med("ttft_own_mean_s"),
                     sum(r.cached_tokens for r in runs), sum(r.preemptions for r in runs), med("step_ms"),
                     min((r.step_min_ms for r in runs if r.step_min_ms is not None), default=None),
                     med("decode_cpu_tok_s"), med("step_cpu_ms"))


# ---- report ----------------------------------------------------------------------------------------
Row = tuple[RunResult, RunResult, RunResult, int]   # kvmesh, one-at-a-time ref, batched ref, greedy matches


def table(rows: list[Row], repeats: int) -> str:
    head = ("| concurrency | kvmesh decode tok/s | batched ref decode tok/s | ratio vs batched "
            "| ref decode tok/s (1 at a time) | ratio vs 1 at a time | kvmesh step ms (median / min) "
            "| min step / min step at 1 | batched ref step ms (median / min) | fastest-step ratio vs batched "
            "| step CPU ms kvmesh / batched ref | CPU step / CPU step at 1 | decode ratio vs batched, CPU time "
            "| kvmesh e2e tok/s | batched ref e2e tok/s | e2e ratio vs batched | kvmesh TTFT ms "
            "| batched ref TTFT ms | ref TTFT ms (own) | greedy match |")
    lines = [head, "|" + "---:|" * (head.count("|") - 1)]
    base_step = rows[0][0].step_min_ms if rows and rows[0][0].concurrency == 1 else None
    base_cpu = rows[0][0].step_cpu_ms if rows and rows[0][0].concurrency == 1 else None
    for k, r, b, matched in rows:
        flat = f"{k.step_min_ms / base_step:.2f}x" if base_step and k.step_min_ms else "-"
        flat_cpu = f"{k.step_cpu_ms / base_cpu:.2f}x" if base_cpu and k.step_cpu_ms else "-"
        lines.append(
            f"| {k.concurrency} | {k.decode_tok_s:,.1f} | {b.decode_tok_s:,.1f} | {k.decode_tok_s / b.decode_tok_s:.2f}x "
            f"| {r.decode_tok_s:,.1f} | {k.decode_tok_s / r.decode_tok_s:.2f}x "
            f"| {k.step_ms or float('nan'):.1f} / {k.step_min_ms or float('nan'):.1f} | {flat} "
            f"| {b.step_ms:.1f} / {b.step_min_ms:.1f} | {b.step_min_ms / k.step_min_ms:.2f}x "
            f"| {k.step_cpu_ms or float('nan'):.1f} / {b.step_cpu_ms:.1f} | {flat_cpu} "
            f"| {(k.decode_cpu_tok_s or float('nan')) / b.decode_cpu_tok_s:.2f}x "
            f"| {k.e2e_tok_s:,.1f} | {b.e2e_tok_s:,.1f} | {k.e2e_tok_s / b.e2e_tok_s:.2f}x "
            f"| {k.ttft_mean_s * 1e3:,.0f} | {b.ttft_mean_s * 1e3:,.0f} | {r.ttft_own_mean_s * 1e3:,.0f} "
            f"| {matched}/{2 * k.concurrency * repeats} |")
    return "\n".join(lines)


def plot(rows: list[Row], path: Path, model_name: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cs = [k.concurrency for k, _, _, _ in rows]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax.plot(cs, [k.decode_tok_s for k, _, _, _ in rows], "o-", label="kvmesh decode")
    ax.plot(cs, [b.decode_tok_s for _, _, b, _ in rows], "^-", label="transformers batched generate decode")
    ax.plot(cs, [r.decode_tok_s for _, r, _, _ in rows], "s-", label="transformers generate decode (1 at a time)")
    ax.plot(cs, [k.e2e_tok_s for k, _, _, _ in rows], "o--", label="kvmesh end-to-end")
    ax.plot(cs, [b.e2e_tok_s for _, _, b, _ in rows], "^--", label="transformers batched end-to-end")
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xticks(cs, [str(c) for c in cs])
        a.set_xlabel("concurrent requests")
        a.grid(True, which="both", alpha=0.3)
    ax.set_yscale("log")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"throughput ({model_name}, fp32, CPU)", fontsize=10)
    ax.legend(fontsize=7)
    ax2.plot(cs, [k.step_ms for k, _, _, _ in rows], "o-", label="kvmesh decode step, median")
    ax2.plot(cs, [k.step_min_ms for k, _, _, _ in rows], "o--", label="kvmesh decode step, fastest")
    ax2.plot(cs, [b.step_min_ms for _, _, b, _ in rows], "^--", label="transformers batched step, fastest")
    ax2.plot(cs, [k.step_cpu_ms for k, _, _, _ in rows], "o:", label="kvmesh decode step, median CPU time")
    ax2.plot(cs, [b.step_cpu_ms for _, _, b, _ in rows], "^:", label="transformers batched step, median CPU time")
    ax2.set_ylim(bottom=0)
    ax2.set_ylabel("ms per decode step (all requests decoding)")
    ax2.set_title("decode step time vs batch size", fontsize=10)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- decode step time vs batch size alone (--step-sweep) --------------------------------------------
def step_sweep(engine: Engine, levels: list[int], args, vocab: int, rounds: int = 3) -> list[str]:
    """kvmesh alone: median and fastest decode step per batch size, the sizes interleaved over
    `rounds` so that a burst of other load hits every size alike."""
    steps: dict[int, list[RunResult]] = {c: [] for c in levels}
    for r in range(rounds):
        for i, c in enumerate(levels):
            run, _ = run_kvmesh(engine, make_prompts(c, args.prompt_len, vocab, seed=70_000 + 100 * r + i),
                                args.max_tokens)
            steps[c].append(run)
    base = min(x.step_min_ms for x in steps[levels[0]])
    cpu = {c: statistics.median(x.step_cpu_ms for x in runs) for c, runs in steps.items()}
    lines = ["| batch size | median decode step ms | fastest decode step ms | fastest / fastest at "
             f"{levels[0]} | median step CPU ms | CPU step / CPU step at {levels[0]} "
             "| decode tok/s at the fastest step |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for c, runs in steps.items():
        fastest = min(x.step_min_ms for x in runs)
        lines.append(f"| {c} | {statistics.median(x.step_ms for x in runs):.1f} | {fastest:.1f} "
                     f"| {fastest / base:.2f}x | {cpu[c]:.1f} | {cpu[c] / cpu[levels[0]]:.2f}x "
                     f"| {c * 1e3 / fastest:,.0f} |")
    return lines


# ---- speculative decoding (--speculative K) -----------------------------------------------------------
# Openings in the style of the built-in model's corpus: what follows each is the model's own text.
OPENINGS = ("The king said to his servants,", "In the beginning", "And the LORD spoke to Moses, saying,",
            "Then Jesus said to them,", "Blessed is the man who", "Now it happened in those days that",
            "Hear, O Israel:", "The word of the LORD came to me, saying,", "He answered them,",
            "And it came to pass", "My son, keep my words,", "Praise the LORD!", "I will lift up my eyes",
            "The people of the land", "When the men of the city", "Therefore thus says the Lord",
            "And God said,", "After these things", "She said to him,", "They went out of the city",
            "Give thanks to the LORD,", "The heavens declare", "Woe to you,", "Behold, I send",
            "The sons of Aaron", "Let everything that has breath", "Joseph said to his brothers,",
            "So David went up", "The priest shall take", "Wisdom cries aloud", "At that time",
            "You shall not")


def speculative_main(engine: Engine, levels: list[int], args) -> list[str]:
    """The checkpoint's MTP layer as the draft, k = 0..K drafts per step and auto, at each batch size:
    every (batch, k) is run once per round and the k alternate inside a round (their order
    rotating between rounds), so a burst of other load hits every k alike; the table shows
    medians. Greedy tokens of every k > 0 run are compared with the k = 0 run of its round."""
    from kvmesh.workers.spec.mtp import MTPDrafter
    if not len(engine.model.mtp):
        raise SystemExit("--speculative drafts with the checkpoint's MTP layer, and this one has none")
    ks = list(range(args.speculative + 1)) + ["auto"]      # auto: k by the batch (--speculative-auto's table)
    runs = {(c, k): [] for c in levels for k in ks}
    for r in range(args.repeats):
        for c in levels:
            prompts = [engine.encode(OPENINGS[(i + r) % len(OPENINGS)]) for i in range(c)]
            plain = None
            for k in ks[r % len(ks):] + ks[:r % len(ks)]:
                engine.set_drafter(MTPDrafter(engine.model, engine.slots.num_slots) if k else None, k)
                before = dataclasses.replace(engine.counters)
                result, tokens = run_kvmesh(engine, prompts, args.max_tokens)
                after = engine.counters
                runs[c, k].append(dict(result=result, tokens=tokens, steps=after.steps - before.steps,
                                       drafted=after.draft_tokens - before.draft_tokens,
                                       accepted=after.accepted_draft_tokens - before.accepted_draft_tokens,
                                       drafted_steps=after.drafted_steps - before.drafted_steps))
                plain = tokens if k == 0 else plain
            for k in ks[1:]:
                runs[c, k][-1]["equal"] = sum(a == b for a, b in zip(runs[c, k][-1]["tokens"], plain))
            print(f"speculative round {r} c={c} done", file=sys.stderr)
    engine.set_drafter(None)
    lines = ["| batch | k | decode tok/s | vs k=0 | end-to-end tok/s | vs k=0 | decode tok / CPU-s | vs k=0 "
             "| acceptance | drafts / step | tokens / step | greedy equal to k=0 |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    metrics = ("decode_tok_s", "e2e_tok_s", "decode_cpu_tok_s")
    for c in levels:
        base = {m: statistics.median(getattr(x["result"], m) for x in runs[c, 0]) for m in metrics}
        for k in ks:
            xs = runs[c, k]
            dec, e2e, cpu = (statistics.median(getattr(x["result"], m) for x in xs) for m in metrics)
            drafted, accepted = sum(x["drafted"] for x in xs), sum(x["accepted"] for x in xs)
            steps = sum(x["drafted_steps"] for x in xs)
            equal = "-" if k == 0 else f"{sum(x['equal'] for x in xs)}/{c * len(xs)}"
            lines.append(f"| {c} | {k} | {dec:,.1f} | {dec / base['decode_tok_s']:.2f}x | {e2e:,.1f} "
                         f"| {e2e / base['e2e_tok_s']:.2f}x | {cpu:,.1f} | {cpu / base['decode_cpu_tok_s']:.2f}x | " + (f"{accepted / max(drafted, 1):.2f} | "
                         f"{drafted / max(steps, 1):.2f} | {1 + accepted / max(steps, 1):.2f}" if k else "- | - | 1")
                         + f" | {equal} |")
    return lines


# ---- quantized vs bf16 (--quantized) ----------------------------------------------------------------
QUANT_CONFIG = dict(model_type="deepseek_v4", vocab_size=8192, hidden_size=512, num_hidden_layers=6,
                    num_attention_heads=8, head_dim=128, qk_rope_head_dim=32, q_lora_rank=256,
                    moe_intermediate_size=512, n_routed_experts=16, num_experts_per_tok=2, n_shared_experts=1,
                    o_groups=4, o_lora_rank=128, index_n_heads=4, index_head_dim=64, index_topk=8,
                    sliding_window=32, hc_mult=4, num_hash_layers=1,
                    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
                    layer_types=["sliding_attention", "compressed_sparse_attention",
                                 "heavily_compressed_attention"] * 2,
                    max_position_embeddings=4096, dtype="bfloat16")


def quantized_main(args, levels: list[int]) -> int:
    import tempfile

    from tests.quant_checkpoint import dequantize_checkpoint, random_released_checkpoint
    from kvmesh.workers.checkpoint.inspect import resident_bytes
    root = Path(tempfile.mkdtemp(prefix="kvmesh-bench-quant-"))
    qdir = random_released_checkpoint(root / "fp8-fp4", QUANT_CONFIG)
    ddir = dequantize_checkpoint(qdir, root / "bf16")
    engines = {name: Engine(EngineConfig(model=str(d), dtype="bfloat16", max_num_seqs=max(levels),
                                         max_batched_tokens=args.max_batched_tokens, kv_cache_bytes=KV_CACHE_BYTES,
                                         speculative_tokens=0))
               for name, d in (("fp8/fp4", qdir), ("bf16", ddir))}
    files = {"fp8/fp4": (qdir / "model.safetensors").stat().st_size, "bf16": (ddir / "model.safetensors").stat().st_size}
    resident = {name: resident_bytes(e.model) for name, e in engines.items()}
    vocab = QUANT_CONFIG["vocab_size"]
    warm = make_prompts(max(levels), args.prompt_len, vocab, WARMUP_SEED)
    for e in engines.values():
        run_kvmesh(e, warm, args.max_tokens)
    lines = ["| concurrency | FP8/FP4 decode tok/s | bf16 decode tok/s | decode ratio | FP8/FP4 TTFT ms "
             "| bf16 TTFT ms | greedy tokens equal |", "|---:|---:|---:|---:|---:|---:|---:|"]
    raw = []
    for i, c in enumerate(levels):
        runs = {name: [] for name in engines}
        same = 0
        for rep in range(args.repeats):
            prompts = make_prompts(c, args.prompt_len, vocab, seed=1000 * i + rep)
            toks = {}
            for name, e in engines.items():
                r, toks[name] = run_kvmesh(e, prompts, args.max_tokens)
                runs[name].append(r)
            same += sum(a == b for a, b in zip(toks["fp8/fp4"], toks["bf16"]))
            print(f"c={c} #{rep}: " + ", ".join(f"{n} {rs[-1].wall_s:.2f}s" for n, rs in runs.items()),
                  file=sys.stderr)
        q, d = median_run(runs["fp8/fp4"]), median_run(runs["bf16"])
        lines.append(f"| {c} | {q.decode_tok_s:,.1f} | {d.decode_tok_s:,.1f} | {q.decode_tok_s / d.decode_tok_s:.2f}x "
                     f"| {q.ttft_mean_s * 1e3:,.0f} | {d.ttft_mean_s * 1e3:,.0f} | {same}/{c * args.repeats} |")
        raw.append({n: [asdict(r) for r in rs] for n, rs in runs.items()})
    print(f"model: {QUANT_CONFIG['num_hidden_layers']} layers, hidden {QUANT_CONFIG['hidden_size']}, "
          f"{QUANT_CONFIG['n_routed_experts']} experts; bf16 compute; prompt {args.prompt_len} tokens, "
          f"max_tokens {args.max_tokens}, greedy, ignore_eos; torch path (CPU), medians of {args.repeats}")
    print(f"machine: {platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.1f} (shared machine: expect noise)")
    print()
    print("\n".join(lines))
    print()
    print("| weights | file bytes | resident bytes | resident / file | resident vs bf16 |")
    print("|---|---:|---:|---:|---:|")
    for name in engines:
        print(f"| {name} | {files[name]:,} | {resident[name]:,} | {resident[name] / files[name]:.3f} "
              f"| {resident[name] / resident['bf16']:.3f}x |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": QUANT_CONFIG, "files": files, "resident": resident, "runs": raw}, indent=2))
    print(f"\nwrote {out}")
    return 0


# ---- tensor parallelism -------------------------------------------------------------------------
def tp_main(args, levels: list[int], sizes: list[int]) -> int:
    from kvmesh.workers.parallel.replica import LocalProcessLauncher
    model_dir = Path(args.model) if args.model else ensure_default_model()
    rows, raw, tokens = [], [], {}
    for size in sizes:
        engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", max_num_seqs=max(levels),
                                     max_batched_tokens=args.max_batched_tokens, kv_cache_bytes=KV_CACHE_BYTES,
                                     tensor_parallel_size=size, enable_expert_parallel=args.enable_expert_parallel,
                                     prefix_reuse=False, speculative_tokens=0),
                        launcher=LocalProcessLauncher(args.threads))
        vocab = engine.args.vocab_size
        comm = engine.model.shard.comm
        try:
            run_kvmesh(engine, make_prompts(max(levels), args.prompt_len, vocab, WARMUP_SEED), args.max_tokens)
            for i, c in enumerate(levels):
                runs = []
                for rep in range(args.repeats):
                    before, fwd0 = dict(comm.stats), engine.counters.forward_s
                    k, k_tokens = run_kvmesh(engine, make_prompts(c, args.prompt_len, vocab, seed=1000 * i + rep),
                                             args.max_tokens)
                    delta = {key: comm.stats[key] - before[key] for key in before}
                    runs.append((k, delta, engine.counters.forward_s - fwd0))
                    tokens.setdefault((c, rep), {})[size] = k_tokens
                    print(f"tp={size} c={c} #{rep}: {k.wall_s:.2f}s", file=sys.stderr)
                k = median_run([r[0] for r in runs])
                mid = sorted(runs, key=lambda r: r[0].wall_s)[len(runs) // 2]
                rows.append((size, c, k, *mid[1:]))
                raw.append({"tp": size, "concurrency": c, "runs": [{**asdict(r[0]), **r[1], "forward_s": r[2]}
                                                                  for r in runs]})
        finally:
            engine.close()
    same = sum(len({str(v) for v in by.values()}) == 1 for by in tokens.values())
    print(f"model: {model_dir}, fp32; prompt {args.prompt_len}, max_tokens {args.max_tokens}; torch threads "
          f"{args.threads} per rank; expert parallel {args.enable_expert_parallel}; load average "
          f"{os.getloadavg()[0]:.1f}; greedy tokens equal across sizes in {same}/{len(tokens)} runs\n")
    print("| TP | c | TTFT ms | decode tok/s | e2e tok/s | step ms (median) | forward s | in collectives | "
          "collectives / step | KiB reduced / step | step messages | other (compute) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for size, c, k, d, fwd in rows:
        steps = max(d["messages"], 1)
        coll = d["collective_s"] / fwd if fwd else 0.0
        msg = d["message_s"] / fwd if fwd else 0.0
        print(f"| {size} | {c} | {k.ttft_mean_s * 1e3:.0f} | {k.decode_tok_s:.1f} | {k.e2e_tok_s:.1f} | "
              f"{k.step_ms or float('nan'):.1f} | {fwd:.2f} | {coll:.0%} | {d['collectives'] / steps:.0f} | "
              f"{d['collective_bytes'] / steps / 1024:.0f} | {msg:.0%} | {1 - coll - msg:.0%} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": str(model_dir), "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                               "threads_per_rank": args.threads, "load_average": os.getloadavg(),
                               "expert_parallel": args.enable_expert_parallel, "runs": raw}, indent=2))
    print(f"\nwrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: the built-in default model)")
    parser.add_argument("--concurrency", default="1,8,32,64", help="comma-separated request counts")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-batched-tokens", type=int, default=1024, help="kvmesh step token budget")
    parser.add_argument("--repeats", type=int, default=3, help="runs per concurrency; the table shows medians")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads for both systems (default 1: at these shapes a second "
                             "thread buys little, and on a shared machine OpenMP barriers turn it into noise)")
    parser.add_argument("--out", default="bench/out/engine.json")
    parser.add_argument("--step-sweep", action="store_true",
                        help="only kvmesh's decode step time per batch size (no reference; sizes interleaved)")
    parser.add_argument("--speculative", type=int, default=0, metavar="K",
                        help="only speculative decoding with the checkpoint's MTP layer: k = 0..K drafts per "
                             "step, alternated, at each --concurrency (no transformers reference)")
    parser.add_argument("--speculative-auto", metavar="TABLE",
                        help="with --speculative: the batch:k table the auto rows use (default: EngineConfig's)")
    parser.add_argument("--tensor-parallel-size", metavar="N,M",
                        help="compare kvmesh at these tensor-parallel sizes (e.g. 1,2) instead of transformers")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="with --tensor-parallel-size: split routed experts by expert")
    parser.add_argument("--data-parallel-size", type=int, metavar="N",
                        help="compare one process, TP=N+EP and DP=N+EP (data-parallel attention) in one run: "
                             "throughput, KV capacity, the MoE exchange's cost (bench/data_parallel.py); with "
                             "--tensor-parallel-size T also DP=N/T x TP=T; with --speculative: each with and "
                             "without the MTP draft")
    parser.add_argument("--quantized", action="store_true",
                        help="FP8/FP4 released-format checkpoint as shipped vs the same weights in bf16")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.quantized:
        return quantized_main(args, levels)
    if args.data_parallel_size and args.speculative:
        from bench.data_parallel import spec_main
        return spec_main(args, levels, args.data_parallel_size, run_kvmesh, OPENINGS, median_run)
    if args.data_parallel_size:
        from bench.data_parallel import dp_main
        return dp_main(args, levels, args.data_parallel_size, run_kvmesh, make_prompts, median_run, KV_CACHE_BYTES,
                       WARMUP_SEED, int(args.tensor_parallel_size or 1))
    if args.tensor_parallel_size:
        return tp_main(args, levels, [int(n) for n in args.tensor_parallel_size.split(",")])
    model_dir = Path(args.model) if args.model else ensure_default_model()

    # a KV budget with room to spare: a preemption would make the run measure something else
    engine = Engine(EngineConfig(model=str(model_dir), dtype="float32", max_num_seqs=max(levels),
                                 max_batched_tokens=args.max_batched_tokens, kv_cache_bytes=KV_CACHE_BYTES,
                                 prefix_reuse=not args.speculative,    # the k runs repeat their prompts
                                 speculative_tokens=0,    # plain decoding; --speculative sets each k's drafter
                                 speculative_auto=args.speculative_auto or EngineConfig.speculative_auto))
    if args.speculative:
        run_kvmesh(engine, [engine.encode(o) for o in OPENINGS[:max(levels)]], args.max_tokens)   # warm-up
        lines = speculative_main(engine, levels, args)
        print(f"kvmesh speculative decoding with the MTP layer of {model_dir}; openings of the corpus's style, "
              f"max_tokens {args.max_tokens}, greedy, ignore_eos, fp32, medians of {args.repeats} rounds; "
              f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f} "
              f"(1, 5, 15 min: {', '.join(f'{x:.1f}' for x in os.getloadavg())})\n")
        print("\n".join(lines))
        return 0
    if args.step_sweep:
        run_kvmesh(engine, make_prompts(max(levels), args.prompt_len, engine.args.vocab_size, WARMUP_SEED),
                   args.max_tokens)
        print(f"kvmesh decode step vs batch size; prompt {args.prompt_len}, max_tokens {args.max_tokens}, "
              f"load average {os.getloadavg()[0]:.1f}\n")
        print("\n".join(step_sweep(engine, levels, args, engine.args.vocab_size)))
        return 0
    from transformers import DeepseekV4ForCausalLM
    reference = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = engine.args.vocab_size

    warm = make_prompts(max(levels), args.prompt_len, vocab, WARMUP_SEED)   # every step shape kvmesh will see
    run_kvmesh(engine, warm, args.max_tokens)
    run_reference(reference, warm[:2], args.max_tokens)
    run_reference_batched(reference, warm, args.max_tokens)

    rows, raw = [], []
    for i, c in enumerate(levels):
        ks, rs, bs, matched = [], [], [], 0
        for rep in range(args.repeats):   # fresh prompts every repeat: no prefix is ever reused
            prompts = make_prompts(c, args.prompt_len, vocab, seed=1000 * i + rep)
            k, k_tokens = run_kvmesh(engine, prompts, args.max_tokens)
            b, b_tokens = run_reference_batched(reference, prompts, args.max_tokens)
            r, r_tokens = run_reference(reference, prompts, args.max_tokens)
            matched += sum(x == y for x, y in zip(k_tokens, r_tokens)) + sum(x == y for x, y in zip(k_tokens, b_tokens))
            ks.append(k)
            rs.append(r)
            bs.append(b)
            print(f"c={c} #{rep}: kvmesh {k.wall_s:.2f}s, transformers batched {b.wall_s:.2f}s, "
                  f"one at a time {r.wall_s:.2f}s", file=sys.stderr)
        rows.append((median_run(ks), median_run(rs), median_run(bs), matched))
        assert rows[-1][0].cached_tokens == 0 and rows[-1][0].preemptions == 0, "kvmesh run was not cold"
        raw.append({"kvmesh": [asdict(k) for k in ks], "transformers": [asdict(r) for r in rs],
                    "transformers_batched": [asdict(b) for b in bs]})

    a = engine.args
    print(f"model: {model_dir} ({a.num_hidden_layers} layers {'/'.join(t.split('_')[0][:4] for t in a.layer_types)}, "
          f"hidden {a.hidden_size}, vocab {a.vocab_size}), fp32; prompt {args.prompt_len} tokens, "
          f"max_tokens {args.max_tokens}, greedy, ignore_eos")
    print(f"machine: {platform.processor() or platform.machine()}, torch threads {torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print()
    print(table(rows, args.repeats))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "model": str(model_dir), "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
        "max_batched_tokens": args.max_batched_tokens, "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "repeats": args.repeats,
        "median": [{"kvmesh": asdict(k), "transformers": asdict(r), "transformers_batched": asdict(b),
                    "greedy_match": m} for k, r, b, m in rows],
        "runs": raw}, indent=2))
    plot(rows, out.with_suffix(".png"), model_dir.name)
    print(f"\nwrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
