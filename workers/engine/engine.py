"""The engine: one process, one model, many requests (continuous batching).

    engine = Engine(EngineConfig(model=DIR))
    engine.add_request("r1", "hello", SamplingParams(max_tokens=8, temperature=0))
    while engine.has_unfinished():
        for out in engine.step(): ...

Each step is schedule -> run -> process outputs: the `Scheduler` picks the batch (admission
restores prefixes through the KV-cache manager), the `ModelRunner` runs it, the
`OutputProcessor` (engine/output.py) samples, checks stops and finishes or holds sequences.
The parts are wired once by engine/builder.py. `AsyncEngine` (engine/async_engine.py) wraps
this with a background loop and async streams.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvmesh.kvstore.transfer.kv_transport import HandoffError, KVTransport, Offer
from kvmesh.kvstore.transfer.nixl_transfer import NixlTransport, make_agent
from kvmesh.workers.checkpoint.default_model import ensure_default_model
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.model.args import ConfigError
from kvmesh.workers.parallel.collectives import Collectives, RankFailed
from kvmesh.workers.parallel.replica import RankLauncher
from kvmesh.workers.request import HeldKV, RequestOutput, Resume, Sequence, Status
from kvmesh.workers.reuse.prefix_cache import Prefetch
from kvmesh.workers.sampling.grammar import GrammarLimits, Guide, GuideCompiler
from kvmesh.workers.sampling.params import InvalidRequestError, PromptTooLongError, SamplingParams, make_generator
from kvmesh.workers.spec.mtp import MTPDrafter
from kvmesh.workers.spec.speculative import Drafter, DraftLimits, Speculator

from .builder import StoreUnavailable, balancer, build, start_ranks
from .grammar_wait import GrammarWait, Parked
from .output import OutputProcessor, RequestTable
from .protocol import run_to_completion
from .scheduler import Scheduler
from .stats import (
    EngineCounters,
    EngineStats,
    EplbCounters,
    GrammarCounters,
    Histogram,
    PlannerCounters,
    ReuseCounters,
    StoreCounters,
)

__all__ = ["Engine", "EngineConfig", "StoreUnavailable"]
log = logging.getLogger(__name__)
GRAMMAR_POLL_S = 0.01    # an engine with nothing to run but parked requests waits this long for a compile or a read
MISS_WAIT_S = 0.001      # a step waits at most this long for new requests' lookups to tell a miss (issue 45 item 2)
LOADER_THREADS = 4       # prefetches (index lookup + store reads) in flight at once


class Engine:
    """With tensor_parallel_size N > 1 this process is rank 0 of N (workers/parallel/replica.py):
    `launcher` starts the others (default: local processes); close() stops them.

    With data_parallel_size N > 1 an Engine is one DP rank (`dp`: the replica's process group),
    built by `DataParallelEngine` (engine/data_parallel.py; `open_engine` picks the class): each
    step first agrees with the other ranks whether anyone runs a batch, and runs an empty one
    through the MoE exchange when it has none."""

    def __init__(self, config: EngineConfig = EngineConfig(), launcher: RankLauncher | None = None,
                 dp: Collectives | None = None):
        if config.data_parallel_size > 1 and dp is None:
            raise ConfigError(f"data_parallel_size={config.data_parallel_size}: build the engine with "
                              f"kvmesh.workers.engine.open_engine(config) (a DataParallelEngine), not Engine(config)")
        self.config, self.dp = config, dp
        self.model_dir = model_dir = Path(config.model) if config.model else ensure_default_model()
        self.ranks = start_ranks(config, model_dir, launcher, dp)
        try:
            parts = build(config, model_dir, self.ranks, dp)
        except BaseException:
            if self.ranks is not None:
                self.ranks.close("rank 0 failed to start")
            raise
        self.args, self.model, self.tokenizer = parts.args, parts.model, parts.tokenizer
        self.layout, self.policy, self.cache = parts.layout, parts.policy, parts.cache
        self.blocks, self.slots, self.kv = parts.blocks, parts.slots, parts.kv
        self.fingerprint, self.prefix, self.runner = parts.fingerprint, parts.prefix, parts.runner
        self.max_model_len = parts.max_model_len
        experts = self.ranks.experts if self.ranks is not None and dp is not None else dp
        self.balancer = balancer(config, self.model, experts)     # EPLB: None unless enabled
        a = self.args
        self.table = RequestTable()
        self.seqs, self.groups, self.held = self.table.seqs, self.table.groups, self.table.held
        self.counters = EngineCounters()
        self.planner_counters = PlannerCounters()
        self.queue_time = Histogram()            # arrival -> first scheduled (vLLM's request_queue_time)
        self.scheduler = Scheduler(self.kv, self.slots.num_slots, config.max_batched_tokens, on_admit=self._admit)
        if self.prefix.events is not None:      # the load routers read with the KV events
            self.prefix.events.load = self.queued_tokens
        eos = frozenset(a.eos_token_ids) | frozenset(self.tokenizer.stop_token_ids)   # config + end-of-turn
        self.guides = GuideCompiler(self.tokenizer, a.vocab_size, sorted(eos),
                                    GrammarLimits(config.max_schema_bytes, config.grammar_compile_timeout_s,
                                                  config.grammar_compile_memory_bytes, config.grammar_compile_workers))
        self.grammar_wait = GrammarWait()
        self.restore_wait = Parked()        # requests whose hit's store reads run on a loader thread
        self._just_parked: list[Sequence] = []     # ... parked since the last step (a miss need not wait one)
        self._loader = (ThreadPoolExecutor(LOADER_THREADS, thread_name_prefix="kvmesh-prefetch")
                        if self.prefix.staged is not None else None)
        self.outputs = OutputProcessor(self.tokenizer, eos, self.table, self.scheduler, self.prefix,
                                       self.counters)
        if config.cuda_graphs and torch.device(config.device).type == "cuda":
            self.enable_decode_graphs()
        self.rule = config.draft_rule(bool(len(self.model.mtp)))        # whatever the parallel sizes
        self.config = config = dataclasses.replace(
            config, speculative_tokens=(config.speculative_tokens or "auto") if self.rule is not None else 0)
        self.speculator: Speculator | None = None
        if self.rule is not None:
            if not len(self.model.mtp):
                raise ConfigError(f"speculative_tokens={config.speculative_tokens} drafts with the checkpoint's MTP "
                                  f"layer, and {model_dir} has none (no mtp.* weights)")
            share = self.ranks.draft if self.ranks is not None else None     # TP: every rank runs the passes
            idle = self.ranks.idle_passes if self.ranks is not None and dp is not None else None
            self.set_drafter(MTPDrafter(self.model, self.slots.num_slots, share, idle))

    def enable_decode_graphs(self, capture: bool = True) -> None:
        """Decode steps take the fixed-shape path, padded to batch-size buckets and replayed from
        CUDA graphs (`capture`; False runs the same path eagerly, which works on any device).
        Reserves one state slot and one block for the padding rows. A model or cache the path
        cannot run (see cuda_graphs.graph_blockers) keeps the ordinary path, with a warning."""
        from .cuda_graphs import DecodeGraphs, graph_blockers
        blockers = graph_blockers(self.model, self.cache)
        if self.ranks is not None or self.dp is not None:   # a replayed graph sends nothing to the other ranks
            blockers.append("not with tensor_parallel_size or data_parallel_size > 1 yet")
        if blockers:
            log.warning("decode CUDA graphs off: %s", "; ".join(blockers))
            return
        max_blocks = -(-self.max_model_len // self.config.block_tokens)
        self.runner.graphs = DecodeGraphs(self.model, self.cache, self.config.block_tokens, max_blocks,
                                          *self.kv.reserve_scratch(),
                                          self.config.max_num_seqs, self.config.device, capture)

    def set_drafter(self, drafter: Drafter | None, k: int | str | None = None) -> None:
        """Speculative decoding with `drafter` proposing k tokens per step, or by the batch with
        "auto" (default: as the config says); None turns it off."""
        rule = self.rule if k is None else dataclasses.replace(self.config, speculative_tokens=k).draft_rule(True)
        if drafter is None or rule is None or rule.k == 0:
            self.speculator = None
            return
        a = self.args
        ratios = tuple(sorted({r for r in a.compress_ratios if r}))
        limits = DraftLimits(ratios, self.config.block_tokens, a.sliding_window)
        self.speculator = Speculator(drafter, rule, limits, self.cache)

    def flush(self) -> None:
        """Wait until every persisted block and checkpoint is durable in the store."""
        self.prefix.flush()

    def close(self) -> None:
        self.guides.close()
        if self._loader is not None:
            self._loader.shutdown(wait=False, cancel_futures=True)
        self.kv.close()
        self.prefix.close()
        if self.ranks is not None:
            self.ranks.close()

    # ---- requests -------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and (set(map(type, prompt)) <= {int}      # C speed: 0.2 ms at 8K ids, not 4
                                           or all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            ids = list(prompt)
        else:
            raise InvalidRequestError("must be a string or a list of integer token ids", "prompt")
        if not ids:
            raise InvalidRequestError("must not be empty", "prompt")
        if min(ids) < 0 or max(ids) >= self.args.vocab_size:
            bad = [t for t in ids if not 0 <= t < self.args.vocab_size]
            raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.args.vocab_size})",
                                      "prompt")
        return ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    hold_kv: bool = False, resume: Resume | None = None, wait: bool = True) -> Sequence:
        """Queue a request. `hold_kv`: stop after the first token and keep its cache for a
        handoff (prefill role). `resume`: the prompt's cache comes from another engine and
        decoding continues after `resume.first` (decode role). `wait`: a grammar not compiled
        yet is compiled here first (its InvalidRequestError raises); False: the request waits
        for it outside the batch (engine/grammar_wait.py) and a failed compile finishes it with
        an error output, so a caller on the step's thread never waits for a compile."""
        if request_id in self.seqs or request_id in self.held:
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        ids = self.prepare(prompt, params)
        grammar = self.guides.compile_async(params.guide) if params.guide else None
        if grammar is not None and wait:
            grammar.result()
        seq = Sequence(request_id, ids, params, make_generator(params), arrival=time.monotonic(),
                       hold_kv=hold_kv, resume=resume)
        self.counters.prompt_tokens += len(ids)
        self.planner_counters.arrived_requests += 1
        self.seqs[request_id] = seq
        if grammar is not None and not grammar.done():
            self.grammar_wait.park(seq, grammar)
            return seq
        try:
            self._queue(seq, grammar.result() if grammar is not None else None)
        except BaseException:
            del self.seqs[request_id]
            raise
        return seq

    def _queue(self, seq: Sequence, grammar) -> None:
        """Hand a checked request (its grammar compiled, or None) to the scheduler."""
        seq.guide = Guide(grammar, self.args.vocab_size) if grammar is not None else None
        if seq.resume is not None:
            self._resume_lead(seq, seq.resume)
        if self._loader is not None and self.prefix.wants_prefetch(seq):
            job = Prefetch()
            budget = self.config.restore_wait_s + self.config.restore_wait_s_per_1k_tokens * len(seq.prompt) / 1000
            future = self._loader.submit(self.prefix.prefetch, self.prefix.prefetch_chain(seq), len(seq.prompt), job)
            seq.prefetched = job
            self.restore_wait.park(seq, future, time.monotonic() + budget)
            self._just_parked.append(seq)
            return
        self._schedule(seq)

    def _schedule(self, seq: Sequence) -> None:
        if seq.params.n > 1 and not seq.hold_kv:     # a held request forks on the decode worker
            self.groups[seq.request_id] = [seq]
        self.scheduler.add(seq)

    def _join_compiled(self) -> list[RequestOutput]:
        """Queue the parked requests whose grammar is ready, and those whose prefetch ended or
        ran out of time; error outputs for those whose compile failed. With nothing else to run
        (and no data-parallel lockstep to keep), first wait a little for either, or for a handoff
        load off the step, instead of spinning."""
        self._schedule_misses()
        loads = self.kv.load_futures()
        if self.dp is None and (self.grammar_wait or self.restore_wait or loads) and not self.scheduler.has_batch():
            until = self.restore_wait.next_deadline() - time.monotonic()
            concurrent.futures.wait(self.grammar_wait.futures() + self.restore_wait.futures() + loads,
                                    max(0.0, min(GRAMMAR_POLL_S, until)), return_when=concurrent.futures.FIRST_COMPLETED)
        for seq, _ in self.restore_wait.ready():        # late reads: what arrived counts, the rest is recomputed
            self._schedule(seq)
        failed = []
        for seq, grammar in self.grammar_wait.ready():
            try:
                self._queue(seq, grammar.result())
            except Exception as e:      # InvalidRequestError: unusable or over budget; only this request fails
                seq.status = Status.FINISHED
                failed.append(self.outputs.failure(seq, e))
        return failed

    def _schedule_misses(self) -> None:
        """The requests parked for a prefetch since the last step whose lookup found nothing to
        read from the store (a miss, or a hit all in memory) join this step: wait up to
        MISS_WAIT_S in all for their lookups to say so, instead of a whole step (a hit that reads
        is left to its reads)."""
        fresh, self._just_parked = self._just_parked, []
        until = time.monotonic() + MISS_WAIT_S
        for seq in fresh:
            job = seq.prefetched
            if job.decided.wait(max(0.0, until - time.monotonic())) and not job.reads \
                    and self.restore_wait.drop(seq.request_id):
                self._schedule(seq)

    def prepare(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids once the request is checked (InvalidRequestError /
        PromptTooLongError otherwise); changes nothing."""
        params.validate()
        outside = sorted(t for t, _ in params.logit_bias if t >= self.args.vocab_size)
        if outside:
            raise InvalidRequestError(f"token ids {outside[:5]} are outside the vocabulary [0, "
                                      f"{self.args.vocab_size})", "logit_bias")
        ids = self.encode(prompt)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's limit "
                f"of {self.max_model_len} tokens")
        return ids

    def _resume_lead(self, seq: Sequence, resume: Resume) -> None:
        """Decode role: the cache continues the first sequence that has not ended yet (n > 1:
        sequence 0 may have ended on its first token); the others fork from it at admission."""
        firsts = [resume.first, *resume.siblings]
        lead = next(f for f in firsts if f.finish is None)
        seq.index, seq.output, seq.logprobs, seq.emitted = lead.index, [lead.token], [lead.logprob], 1
        seq.top_logprobs = [list(lead.top)]
        seq.siblings = [f for f in firsts if f is not lead]
        seq.cached_tokens = resume.cached_tokens
        if lead.index:
            seq.generator = make_generator(seq.params, lead.index)
        if seq.guide is not None:
            seq.guide.accept(lead.token)
        if resume.rng_state is not None and seq.generator is not None and lead.index == 0:
            seq.generator.set_state(resume.rng_state)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its cache, wherever it is: waiting, running, or already
        held for a handoff (a cancel can race the step that moves it to `held`)."""
        seq = self.seqs.pop(request_id, None)
        if self.grammar_wait.drop(request_id) or self.restore_wait.drop(request_id):    # parked: holds nothing
            seq = None
        for s in self.groups.pop(request_id, None) or ([seq] if seq is not None else []):
            if s.status != Status.FINISHED:
                s.finish_reason = "abort"
                self.scheduler.finish(s)
        self.release_held(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self.grammar_wait) or bool(self.restore_wait)

    def reap_landing(self) -> bool:
        """Take back the memory of handoffs given up while their transfer was in flight, where
        it is over (each step does this too); True while some is still out."""
        self.kv.reap_landing()
        return self.kv.landing > 0

    # ---- the step -------------------------------------------------------------------------
    def _admit(self, seq: Sequence) -> None:
        """Run when a request holds its cache (restored, loaded from a handoff, or empty):
        a handed-off request with n > 1 forks its siblings here."""
        if seq.params.prompt_logprobs is not None:   # every prompt position is computed (again)
            seq.prompt_lps = []
        if seq.resume is not None and seq.resume.mtp is not None and seq.index == 0 and self.speculator is not None:
            # the MTP state is sequence 0's (n > 1: a sibling that leads drafts from its second step)
            self.speculator.drafter.adopt(seq, seq.resume.mtp)
            self.counters.handoff_draft_tokens += len(seq.resume.mtp.drafts)
        if seq.resume is not None and seq.siblings:
            for first in seq.siblings:
                child = self.outputs.child(seq, first.index)
                child.output, child.logprobs, child.emitted = [first.token], [first.logprob], 1
                child.top_logprobs = [list(first.top)]
                if first.finish is not None:      # ended on its first token at prefill: only counted
                    child.status, child.finish_reason = Status.FINISHED, first.finish
                    self.groups.setdefault(seq.request_id, [seq]).append(child)
                    continue
                if child.guide is not None:
                    child.guide.accept(first.token)
                self.outputs.attach(seq, child)
            seq.siblings = []

    # ---- handoff (prefill role) --------------------------------------------------------------
    def held_handle(self, request_id: str) -> HeldKV:
        seq = self.held[request_id]
        rng = seq.generator.get_state() if seq.generator is not None else None
        return HeldKV(request_id, list(seq.blocks), seq.slot, seq.num_computed, list(seq.tokens), rng,
                      self.fingerprint, seq.mtp_handoff)

    def is_held(self, request_id: str) -> bool:
        return request_id in self.held

    def export_held(self, request_id: str) -> dict[str, torch.Tensor]:
        seq = self.held[request_id]
        return self.cache.gather(seq.blocks, seq.slot)

    def offer_held(self, request_id: str, transport: KVTransport, skip: int = 0) -> Offer:
        """Make a held request's blocks + slot readable through `transport`, all but the first
        `skip` blocks (the destination holds them); HandoffError if not held."""
        if request_id not in self.held:
            raise HandoffError(f"this engine does not hold request {request_id}")
        return transport.offer(self.held_handle(request_id), self.cache, skip)

    def kv_tensors(self) -> list[torch.Tensor]:
        """Every cache tensor (blocks and slots), for a transport to register once."""
        return self.cache.all_tensors()

    def release_held(self, request_id: str) -> None:
        seq = self.held.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)

    def open_nixl(self, name: str, node_ip: str, backend: str, timeout_s: float) -> NixlTransport | None:
        """A NIXL transport over this engine's cache, registered with an agent called `name`
        (None, with a warning, when NIXL cannot run here: handoffs then use Ray copies)."""
        agent, _ = make_agent(name, self.kv_tensors(), node_ip, backend)
        return NixlTransport(agent, self.fingerprint, timeout_s) if agent is not None else None

    def release_read(self, transport: NixlTransport) -> list[str]:
        """Free the held caches destinations have finished reading (`transport.released()`);
        their request ids."""
        read = transport.released()
        for rid in read:
            self.release_held(rid)
        return read

    def stats(self) -> EngineStats:
        """Load, memory and counters now (cheap: read between steps, or racily from another thread)."""
        r, store = self.prefix.stats, self.prefix.store
        reuse = ReuseCounters(
            query_tokens=r.query_tokens, hit_tokens_by_tier=dict(r.tier_hit_tokens), hits=r.hits,
            hit_tokens=r.hit_tokens, bytes_loaded=r.bytes_loaded, blocks_from_store=r.blocks_from_store,
            blocks_from_memory=r.blocks_from_memory, recomputed_tokens=r.recomputed_tokens, errors=r.errors)
        s = store.stats() if store is not None else None
        stored = None if s is None else StoreCounters(
            bytes_read=s.bytes_read, bytes_written=s.bytes_written, reads=s.reads, writes=s.writes,
            corrupt=s.corrupt, bytes=s.total_bytes, read_errors=s.read_errors, timeouts=s.timeouts,
            quarantined=s.quarantined, scrub_passes=s.scrub_passes, scrub_last_pass_s=s.scrub_last_pass_s,
            scrub_objects={"ok": s.scrub_ok, "removed": s.scrub_removed, "quarantined": s.scrub_quarantined})
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting), held=len(self.held),
            free_blocks=self.blocks.num_free, total_blocks=self.blocks.num_blocks, free_slots=self.slots.num_free,
            total_slots=self.slots.num_slots, preemptions=self.scheduler.preemptions,
            kv_cache_usage=self.blocks.num_used / max(1, self.blocks.num_blocks),
            counters=dataclasses.replace(self.counters), queue_time=self.queue_time.snapshot(),
            reuse=reuse, store=stored, grammar=GrammarCounters(len(self.grammar_wait), **self.guides.stats()._asdict()),
            eplb=EplbCounters(**self.balancer.counters()) if self.balancer is not None else None,
            restoring=len(self.restore_wait) + self.kv.loading, queued_prompt_tokens=self.queued_prompt_tokens(),
            planner=dataclasses.replace(self.planner_counters))

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens of the sequences waiting or running that no step has computed yet."""
        seqs = list(self.scheduler.waiting) + list(self.scheduler.running)
        return sum(max(0, len(s.prompt) - s.num_computed) for s in seqs)

    def queued_tokens(self) -> int:
        """The load routers weigh against a prefix's blocks: tokens left to prefill, plus the
        context of every sequence waiting or running (the KV it holds or will, which each of its
        decode steps reads: a rank busy decoding long contexts is not taken for idle). Read racily
        from the event publisher's thread: copies, then sums."""
        seqs = list(self.scheduler.waiting) + list(self.scheduler.running)
        return sum(s.remaining_prefill() + s.length for s in seqs)

    def cache_digests(self) -> list[str]:
        """Each rank's cache digest (CacheTensors.digest), in rank order: under tensor parallelism
        the ranks hold identical copies, so every entry is the same."""
        if self.ranks is None:
            return [self.cache.digest()]
        return self.ranks.cache_digests()

    @property
    def rank_stats(self) -> list[EngineStats]:
        """This engine's stats as the only rank's (EngineProtocol: a DataParallelEngine has one per rank)."""
        return [self.stats()]

    def step(self) -> list[RequestOutput]:
        """One scheduling step. Under tensor parallelism a rank that died or stalled raises
        RankFailed (within rank_timeout_s); the engine is unusable after it."""
        if self.ranks is not None:
            self.ranks.check()
        try:
            outputs = self._step()
            if self.balancer is not None:        # every DP rank, after every step: count, rebalance when due
                if self.ranks is not None:       # TP inside the DP rank: the group's ranks count with this one
                    self.ranks.balance()
                self.balancer.end_step()
            return outputs
        except RankFailed as e:
            if self.ranks is not None:
                self.ranks.failed(e)
            raise

    def _step(self) -> list[RequestOutput]:
        failed = self._join_compiled()
        t0 = time.perf_counter()
        batch, unloaded = self.scheduler.schedule()    # admission restores prefixes here
        failed += [self.outputs.failure(seq, e.__cause__ or e) for seq, e in unloaded]
        spec = self.speculator
        k = spec.rule.for_batch(len(batch)) if spec is not None else 0    # the MTP passes after this step
        if self.dp is not None:     # every DP rank says whether it has a batch, and the k it wants: all use the largest
            k = max(self.dp.all_counts(1 + k if batch else 0)) - 1
            if k >= 0 and not batch:
                self.runner.idle()                   # join the others' exchanges
                if spec is not None:
                    spec.drafter.idle(k)
        if not batch:
            return failed
        now = time.monotonic()
        for seq, _ in batch:
            if not seq.scheduled:
                seq.scheduled = True
                self.queue_time.observe(now - seq.arrival)
        t1 = time.perf_counter()
        drafts = spec.propose(batch) if spec else {}
        saved = spec.save(batch, drafts) if drafts else None
        starts = [seq.num_computed for seq, _ in batch]
        prompt_tokens = sum(min(n, max(0, len(seq.prompt) - seq.num_computed)) for seq, n in batch)
        decoding = [start for (seq, _), start in zip(batch, starts) if start >= len(seq.prompt)]
        observe = spec is not None and spec.drafter.wants_streams
        logits, sampled, extra = self.runner.run(batch, drafts, keep_streams=observe)
        self.counters.restore_s += t1 - t0
        forward_s = time.perf_counter() - t1
        self.planner_counters.step(forward_s, prompt_tokens, len(decoding), sum(decoding))
        self.counters.forward_s += forward_s
        if self.prefix.auto is not None:
            self.prefix.auto.observe_prefill(sum(n for _, n in batch), forward_s)
        self.counters.steps += 1
        sample_rows = len(sampled) + sum(len(d) for d in drafts.values())
        if extra:
            self.outputs.prompt_logprobs(batch, logits[sample_rows:], extra)
        for seq, n in batch:
            seq.num_computed += n
            self.prefix.after_step(seq)
        if drafts:
            outputs = self.outputs.speculated(batch, logits, sampled, drafts, saved, spec)
        else:
            outputs = self.outputs.sample(batch, logits, sampled)
        if observe:         # a model draft runs on what this step computed, for the next step
            spec.drafter.observe(batch, starts, *self.runner.last, k)
        outputs = failed + outputs
        if self.prefix.events is not None and any(o.finished for o in outputs):
            self.prefix.events.nudge()       # the router sees this rank's load fall now, not in a second
        return outputs

    # ---- convenience ------------------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[RequestOutput]:
        """Run all prompts concurrently to completion (engine/protocol.py `run_to_completion`)."""
        return run_to_completion(self, prompts, params)
