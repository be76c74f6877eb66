"""The engine: one process, one model, many requests (continuous batching).

    engine = Engine(EngineConfig(model=DIR))
    engine.add_request("r1", "hello", SamplingParams(max_tokens=8, temperature=0))
    while engine.has_unfinished():
        for out in engine.step(): ...

`AsyncEngine` (workers.async_engine) wraps it with a background loop and async streams.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import os
import socket

import torch

from kvstore.block_pool import BlockPool
from kvstore.cache_tensors import CacheTensors, size_pools
from kvstore.hashing import PrefixHasher, model_fingerprint
from kvstore.host_cache import HostCache
from kvstore.index import make_index
from kvstore.kv_transport import HandoffError, KVTransport, Offer
from kvstore.mac import StoreKey
from kvstore.layout import LAYOUT_VERSION, CacheLayout, LayoutParams
from kvstore.planner import recompute_span
from kvstore.redact import redact_url
from kvstore.state_slots import SlotPool
from kvstore.store import ObjectStore

from .default_model import ensure_default_model
from .loader import load_model
from .auto_policy import AutoPeriod
from .weights_id import weights_identity
from .prefix_cache import PrefixCache
from .runner import ModelRunner
from .grammar import GuideCompiler
from .histogram import Histogram
from .sampler import SampleRow, sample_batch
from .sampling import InvalidRequestError, PromptTooLongError, SamplingParams, make_generator
from .kv_manager import KVCacheManager
from .scheduler import Scheduler
from .handoff import HeldKV, Resume
from .sequence import RequestOutput, Sequence, Status
from .config import ConfigError, ModelArgs
from .collectives import RankFailed
from .engine_config import EngineConfig
from .engine_stats import EngineCounters, EngineStats
from .model import SINGLE, Shard
from .parallel import Leader, LocalProcessLauncher, RankLauncher
from .sharding import check_sizes
from .mtp_draft import MTPDrafter
from .speculative import DraftLimits, Drafter, Speculator
from .tokenizer import load_tokenizer

log = logging.getLogger(__name__)
STORE_STAGING_BYTES = 32 << 20     # the store reads restored blocks into this reused buffer


class StoreUnavailable(RuntimeError):
    """`require_store` is set and the store or index could not be opened."""


class Engine:
    """With tensor_parallel_size N > 1 this process is rank 0 of N (workers/parallel.py):
    `launcher` starts the others (default: local processes); close() stops them."""

    def __init__(self, config: EngineConfig = EngineConfig(), launcher: RankLauncher | None = None):
        self.config = config
        model_dir = Path(config.model) if config.model else ensure_default_model()
        self.model_dir = model_dir
        self.ranks: Leader | None = None
        shard = SINGLE
        if config.tensor_parallel_size != 1:
            check_sizes(ModelArgs.from_file(model_dir / "config.json"), config.tensor_parallel_size,
                        config.enable_expert_parallel)
            if config.speculative_tokens:
                raise ConfigError(f"speculative_tokens={config.speculative_tokens} (the MTP draft) is not supported "
                                  f"with tensor_parallel_size={config.tensor_parallel_size} yet")
            self.ranks = Leader(config, launcher or LocalProcessLauncher())
            shard = Shard(0, config.tensor_parallel_size, config.enable_expert_parallel, comm=self.ranks.comm)
        try:
            self._start(model_dir, shard)
        except BaseException:
            if self.ranks is not None:
                self.ranks.close("rank 0 failed to start")
            raise

    def _start(self, model_dir: Path, shard: Shard) -> None:
        config = self.config
        self.args, self.model = load_model(model_dir, config.dtype, config.device, config.kernel_backend, shard)
        self.tokenizer = load_tokenizer(model_dir)
        dtype = self.model.head.weight.dtype
        dtype_name = str(dtype).removeprefix("torch.")
        a = self.args
        self.layout = CacheLayout.build(
            LayoutParams(a.layer_types, a.head_dim, a.index_head_dim, a.csa_ratio, a.hca_ratio,
                         a.sliding_window, dtype_name, config.kv_cache_dtype, a.rope_head_dim), config.block_tokens)
        self.policy = config.policy
        swa_blocks = self.policy.kind == "full"
        num_blocks, num_slots = size_pools(self.layout, config.kv_cache_bytes, config.max_num_seqs, swa_blocks)
        self.cache = CacheTensors(self.layout, num_blocks, num_slots, dtype, config.device, swa_blocks)
        self.raw_cache = self.cache          # what the forward writes; under TP self.cache records calls
        if self.ranks is not None:
            self.cache = self.ranks.ready(self.raw_cache)
        self.blocks, self.slots = BlockPool(num_blocks), SlotPool(num_slots)
        kv = config.kv_cache_dtype    # part of the fingerprint: a bf16 object is never read as fp8
        self.prefix = self._prefix_cache(model_dir, dtype_name if kv == "auto" else f"{dtype_name}/kv:{kv}", swa_blocks)
        self.kv = KVCacheManager(self.cache, self.blocks, self.slots, self.prefix)
        self.scheduler = Scheduler(self.kv, num_slots, config.max_batched_tokens, on_admit=self._admit)
        self.runner = ModelRunner(self.model, self.raw_cache, config.device, self.ranks)
        self.max_model_len = min(config.max_model_len or a.max_position_embeddings,
                                 num_blocks * config.block_tokens)
        if config.cuda_graphs and torch.device(config.device).type == "cuda":
            self.enable_decode_graphs()
        self.seqs: dict[str, Sequence] = {}
        self.groups: dict[str, list[Sequence]] = {}   # n > 1: every sequence of a request, index order
        self.held: dict[str, Sequence] = {}
        self._eos = frozenset(a.eos_token_ids) | frozenset(self.tokenizer.stop_token_ids)   # config + end-of-turn
        self.guides = GuideCompiler(self.tokenizer, a.vocab_size,
                                    sorted(set(a.eos_token_ids) | set(self.tokenizer.stop_token_ids)))
        self.counters = EngineCounters()
        self.queue_time = Histogram()            # arrival -> first scheduled (vLLM's request_queue_time)
        self.speculator: Speculator | None = None
        if config.speculative_tokens > 0:
            if not len(self.model.mtp):
                raise ConfigError(f"speculative_tokens={config.speculative_tokens} drafts with the checkpoint's MTP "
                                  f"layer, and {model_dir} has none (no mtp.* weights)")
            self.set_drafter(MTPDrafter(self.model, num_slots))

    def enable_decode_graphs(self, capture: bool = True) -> None:
        """Decode steps take the fixed-shape path, padded to batch-size buckets and replayed from
        CUDA graphs (`capture`; False runs the same path eagerly, which works on any device).
        Reserves one state slot and one block for the padding rows. A model or cache the path
        cannot run (see cuda_graphs.graph_blockers) keeps the ordinary path, with a warning."""
        from .cuda_graphs import DecodeGraphs, graph_blockers
        blockers = graph_blockers(self.model, self.cache)
        if self.ranks is not None:     # a replayed graph would not send the step to the other ranks
            blockers.append("not with tensor_parallel_size > 1 yet")
        if blockers:
            log.warning("decode CUDA graphs off: %s", "; ".join(blockers))
            return
        max_blocks = -(-self.max_model_len // self.config.block_tokens)
        self.runner.graphs = DecodeGraphs(self.model, self.cache, self.config.block_tokens, max_blocks,
                                          *self.kv.reserve_scratch(),
                                          self.config.max_num_seqs, self.config.device, capture)

    def set_drafter(self, drafter: Drafter | None, k: int | None = None) -> None:
        """Speculative decoding with `drafter` proposing k tokens per step (default
        config.speculative_tokens); None turns it off."""
        k = self.config.speculative_tokens if k is None else k
        if drafter is None or k <= 0:
            self.speculator = None
            return
        a = self.args
        ratios = tuple(sorted({r for r in a.compress_ratios if r}))
        limits = DraftLimits(ratios, self.config.block_tokens, a.sliding_window)
        self.speculator = Speculator(drafter, k, limits, self.cache)

    def _prefix_cache(self, model_dir: Path, dtype_name: str, swa_blocks: bool) -> PrefixCache:
        c, a = self.config, self.args
        # Block objects carry SWA K=V only under the `full` policy, so that is part of the layout.
        self.fingerprint = model_fingerprint(a.raw, weights_identity(model_dir), dtype_name, c.block_tokens,
                                             LAYOUT_VERSION * 2 + int(swa_blocks))
        hasher = PrefixHasher(self.fingerprint, c.block_tokens)
        key = StoreKey(c.store_key) if c.store_key else None   # a bad key is a config error: fatal
        try:
            store, index = self._open_tiers(key)
        except Exception as e:     # the store and index are an optimisation: serve without them
            if c.require_store:
                raise StoreUnavailable(f"store {c.store!r} / index {redact_url(c.index)!r}: {e}") from e
            log.warning("prefix store/index unusable at start-up (%s: %s): serving without prefix reuse "
                        "(require_store makes this fatal)", type(e).__name__, e)
            store = index = None
        span = recompute_span(a.num_hidden_layers, a.sliding_window, max([a.csa_ratio, a.hca_ratio]))
        worker = c.worker_id or f"{socket.gethostname()}:{os.getpid()}"
        tuner = AutoPeriod(self.layout, capacity_bytes=c.store_capacity_bytes) if self.policy.adaptive else None
        return PrefixCache(self.cache, self.blocks, hasher, self.policy, span, store, index,
                           HostCache(c.host_cache_bytes), worker, enabled=c.prefix_reuse, auto=tuner)

    def _open_tiers(self, key: StoreKey | None):
        c = self.config
        store = (ObjectStore(c.store, self.fingerprint, c.store_capacity_bytes, key=key,
                             read_timeout_s=c.store_read_timeout_s, staging_bytes=STORE_STAGING_BYTES)
                 if c.store else None)
        index = None
        if store is not None or c.index != "local":
            index = make_index(c.index, self.fingerprint, store)
            if store is not None:
                store.attach_index(index)
                if c.index != "local":   # the store is the truth: re-seed a shared index from it
                    index.rebuild_from(store)
        return store, index

    def flush(self) -> None:
        """Wait until every persisted block and checkpoint is durable in the store."""
        self.prefix.flush()

    def close(self) -> None:
        self.prefix.close()
        if self.ranks is not None:
            self.ranks.close()

    # ---- requests -------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        else:
            raise InvalidRequestError("must be a string or a list of integer token ids", "prompt")
        if not ids:
            raise InvalidRequestError("must not be empty", "prompt")
        bad = [t for t in ids if not 0 <= t < self.args.vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.args.vocab_size})",
                                      "prompt")
        return ids

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    hold_kv: bool = False, resume: Resume | None = None) -> Sequence:
        """Queue a request. `hold_kv`: stop after the first token and keep its cache for a
        handoff (prefill role). `resume`: the prompt's cache comes from another engine and
        decoding continues after `resume.first_token` (decode role)."""
        if request_id in self.seqs or request_id in self.held:
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        params.validate()
        ids = self.encode(prompt)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's limit "
                f"of {self.max_model_len} tokens")
        seq = Sequence(request_id, ids, params, make_generator(params), arrival=time.monotonic(),
                       hold_kv=hold_kv, resume=resume)
        seq.guide = self.guides.guide(params.guide) if params.guide else None
        if resume is not None:
            self._resume_lead(seq, resume)
        self.seqs[request_id] = seq
        if params.n > 1 and not hold_kv:     # a held request forks on the decode worker
            self.groups[request_id] = [seq]
        self.scheduler.add(seq)
        self.counters.prompt_tokens += len(ids)
        return seq

    def _resume_lead(self, seq: Sequence, resume: Resume) -> None:
        """Decode role: the cache continues the first sequence that has not ended yet (n > 1:
        sequence 0 may have ended on its first token); the others fork from it at admission."""
        firsts = [(resume.first_token, resume.first_logprob, list(resume.first_top), resume.first_finish)]
        firsts += [tuple(s) + (None,) * (4 - len(s)) for s in resume.siblings]
        lead = next(i for i, f in enumerate(firsts) if f[3] is None)
        token, logprob, top, _ = firsts[lead]
        seq.index, seq.output, seq.logprobs, seq.top_logprobs, seq.emitted = lead, [token], [logprob], [top], 1
        seq.siblings = [(i, f) for i, f in enumerate(firsts) if i != lead]
        seq.cached_tokens = resume.cached_tokens
        if lead:
            seq.generator = make_generator(seq.params, lead)
        if seq.guide is not None:
            seq.guide.accept(token)
        if resume.rng_state is not None and seq.generator is not None and lead == 0:
            seq.generator.set_state(resume.rng_state)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its cache, wherever it is: waiting, running, or already
        held for a handoff (a cancel can race the step that moves it to `held`)."""
        seq = self.seqs.pop(request_id, None)
        for s in self.groups.pop(request_id, None) or ([seq] if seq is not None else []):
            if s.status != Status.FINISHED:
                s.finish_reason = "abort"
                self.scheduler.finish(s)
        self.release_held(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step -------------------------------------------------------------------------
    def _admit(self, seq: Sequence) -> None:
        """Run when a request holds its cache (restored, loaded from a handoff, or empty):
        a handed-off request with n > 1 forks its siblings here."""
        if seq.params.prompt_logprobs is not None:   # every prompt position is computed (again)
            seq.prompt_lps = []
        if seq.resume is not None and seq.siblings:
            for i, (token, logprob, top, finish) in seq.siblings:
                child = self._child(seq, i)
                child.output, child.logprobs, child.top_logprobs, child.emitted = [token], [logprob], [top], 1
                if finish is not None:      # ended on its first token at prefill: only counted
                    child.status, child.finish_reason = Status.FINISHED, finish
                    self.groups.setdefault(seq.request_id, [seq]).append(child)
                    continue
                if child.guide is not None:
                    child.guide.accept(token)
                self._attach(seq, child)
            seq.siblings = []

    # ---- handoff (prefill role) --------------------------------------------------------------
    def held_handle(self, request_id: str) -> HeldKV:
        seq = self.held[request_id]
        rng = seq.generator.get_state() if seq.generator is not None else None
        return HeldKV(request_id, list(seq.blocks), seq.slot, seq.num_computed, list(seq.tokens), rng,
                      self.fingerprint)

    def is_held(self, request_id: str) -> bool:
        return request_id in self.held

    def export_held(self, request_id: str) -> dict[str, torch.Tensor]:
        seq = self.held[request_id]
        return self.cache.gather(seq.blocks, seq.slot)

    def offer_held(self, request_id: str, transport: KVTransport) -> Offer:
        """Make a held request's blocks + slot readable through `transport` (HandoffError if not held)."""
        if request_id not in self.held:
            raise HandoffError(f"this engine does not hold request {request_id}")
        return transport.offer(self.held_handle(request_id), self.cache)

    def kv_tensors(self) -> list[torch.Tensor]:
        """Every cache tensor (blocks and slots), for a transport to register once."""
        return self.cache.all_tensors()

    def release_held(self, request_id: str) -> None:
        seq = self.held.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)

    def stats(self) -> EngineStats:
        """Load, memory and counters now (cheap: read between steps, or racily from another thread)."""
        r, store = self.prefix.stats, self.prefix.store
        reuse = dict(prefix_query_tokens=r.query_tokens, prefix_hit_tokens=dict(r.tier_hit_tokens),
                     reuse_hits=r.hits, reuse_hit_tokens=r.hit_tokens, reuse_bytes_loaded=r.bytes_loaded,
                     reuse_blocks_from_store=r.blocks_from_store, reuse_blocks_from_memory=r.blocks_from_memory,
                     reuse_recomputed_tokens=r.recomputed_tokens, reuse_errors=r.errors)
        s = store.stats() if store is not None else None
        stored = {} if s is None else dict(
            store_bytes_read=s.bytes_read, store_bytes_written=s.bytes_written, store_reads=s.reads,
            store_writes=s.writes, store_corrupt=s.corrupt, store_bytes=s.total_bytes,
            store_read_errors=s.read_errors, store_timeouts=s.timeouts, store_quarantined=s.quarantined)
        return EngineStats(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting), held=len(self.held),
            free_blocks=self.blocks.num_free, total_blocks=self.blocks.num_blocks, free_slots=self.slots.num_free,
            total_slots=self.slots.num_slots, preemptions=self.scheduler.preemptions,
            kv_cache_usage=self.blocks.num_used / max(1, self.blocks.num_blocks),
            counters=dataclasses.replace(self.counters), queue_time=self.queue_time.snapshot(),
            reuse=reuse, store=stored)

    def step(self) -> list[RequestOutput]:
        """One scheduling step. Under tensor parallelism a rank that died or stalled raises
        RankFailed (within rank_timeout_s); the engine is unusable after it."""
        if self.ranks is None:
            return self._step()
        self.ranks.check()
        try:
            return self._step()
        except RankFailed as e:
            self.ranks.failed(e)
            raise

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        batch, failed = self.scheduler.schedule()    # admission restores prefixes here
        failed = [self._failure(seq, e.__cause__ or e) for seq, e in failed]
        if not batch:
            return failed
        now = time.monotonic()
        for seq, _ in batch:
            if not seq.scheduled:
                seq.scheduled = True
                self.queue_time.observe(now - seq.arrival)
        t1 = time.perf_counter()
        spec = self.speculator
        drafts = spec.propose(batch) if spec else {}
        saved = spec.save(batch, drafts) if drafts else None
        starts = [seq.num_computed for seq, _ in batch]
        observe = spec is not None and spec.drafter.wants_streams
        logits, sampled, extra = self.runner.run(batch, drafts, keep_streams=observe)
        self.counters.restore_s += t1 - t0
        forward_s = time.perf_counter() - t1
        self.counters.forward_s += forward_s
        if self.prefix.auto is not None:
            self.prefix.auto.observe_prefill(sum(n for _, n in batch), forward_s)
        self.counters.steps += 1
        sample_rows = len(sampled) + sum(len(d) for d in drafts.values())
        if extra:
            self._prompt_logprobs(batch, logits[sample_rows:], extra)
        for seq, n in batch:
            seq.num_computed += n
            self.prefix.after_step(seq)
        if drafts:
            outputs = self._speculated(batch, logits, sampled, drafts, saved)
        else:
            outputs = self._sample(batch, logits, sampled)
        if observe:         # a model draft runs on what this step computed, for the next step
            spec.drafter.observe(batch, starts, *self.runner.last, spec.k)
        return failed + outputs

    # ---- speculative decoding: rows of a drafted sequence are sampled one by one ----------------
    def _speculated(self, batch, logits: torch.Tensor, sampled: list[int], drafts: dict[int, list[int]],
                    saved) -> list[RequestOutput]:
        plain, plain_rows, accepted, outputs, row = [], [], {}, [], 0
        for b in sampled:
            seq, draft = batch[b][0], drafts.get(b, [])
            if draft:
                accepted[b] = Speculator.accept(logits[row:row + 1 + len(draft)], draft,
                                                lambda x, seq=seq: self._draw(seq, x))
                outputs.append(self._output(seq))
            else:
                plain.append(b)
                plain_rows.append(row)
            row += 1 + len(draft)
        # restore rejected rows before forks of the plain sequences can take a slot freed above
        self.speculator.settle(batch, drafts, accepted, saved)
        outputs += self._sample(batch, logits, plain, plain_rows)
        self.counters.draft_tokens += sum(len(d) for d in drafts.values())
        self.counters.accepted_draft_tokens += sum(accepted.values())
        for b, n_ok in accepted.items():
            seq = batch[b][0]
            if n_ok and not seq.finish_reason:
                self.prefix.after_step(seq)
        return outputs

    def _draw(self, seq: Sequence, logits: torch.Tensor) -> int | None:
        """Sample and append one token from one row; returns it, or None once seq has finished."""
        token, logprob, top = (x[0] for x in sample_batch(logits[None], [self._sample_row(seq)]))
        self._append_token(seq, token, logprob, top)
        return None if seq.finish_reason else token

    def _sample(self, batch, logits: torch.Tensor, sampled: list[int], at: list[int] | None = None
                ) -> list[RequestOutput]:
        """A token for every sequence whose known tokens are all computed (sampled[i]'s logits
        are row at[i], default i); at the first token of a request with n > 1, n tokens from
        the same logits row: the forks."""
        seqs, rows, born = [], [], set()
        for row, b in zip(at if at is not None else range(len(sampled)), sampled):
            seq = batch[b][0]
            seqs.append(seq)
            rows.append(row)
            if seq.params.n > 1 and not seq.output and seq.index == 0:
                for i in range(1, seq.params.n):
                    seqs.append(self._child(seq, i))
                    rows.append(row)
                    born.add(id(seqs[-1]))
        if not seqs:
            return []
        picked = list(zip(seqs, *sample_batch(logits[rows], [self._sample_row(s) for s in seqs])))
        held_forks = set()
        for s, token, logprob, top in picked:
            if id(s) in born:
                parent = self.seqs[s.request_id]
                if parent.hold_kv:      # prefill role: the forks happen on the decode worker
                    parent.siblings.append((token, logprob, top, self._first_finish(s, token)))
                    held_forks.add(id(s))
                else:
                    self._attach(parent, s)
        outputs = []
        for s, token, logprob, top in picked:
            if id(s) not in held_forks:
                self._append_token(s, token, logprob, top)
                outputs.append(self._output(s))
        return outputs

    def _prompt_logprobs(self, batch, logits: torch.Tensor, extra: list[tuple[int, int]]) -> None:
        """logits at prompt position p score prompt token p + 1 (echo with logprobs)."""
        lps = torch.log_softmax(logits.float(), dim=-1)
        k = max(batch[b][0].params.prompt_logprobs for b, _ in extra)
        top_v, top_i = lps.topk(k, dim=1) if k else (None, None)
        nxt = torch.tensor([batch[b][0].prompt[p + 1] for b, p in extra])
        chosen = lps.gather(1, nxt[:, None])[:, 0].tolist()
        for r, (b, p) in enumerate(extra):
            seq = batch[b][0]
            kk = seq.params.prompt_logprobs
            top = list(zip(top_i[r, :kk].tolist(), top_v[r, :kk].tolist())) if kk else []
            seq.prompt_lps.append((chosen[r], top))

    def _sample_row(self, seq: Sequence) -> SampleRow:
        p = seq.params
        stops = self._stops(p)
        banned = tuple(stops) if len(seq.output) < p.min_tokens else ()
        allowed = seq.guide.allowed() if seq.guide is not None else None
        return SampleRow(p, seq.generator, banned, seq.prompt if p.penalized else [],
                         seq.output if p.penalized else [], allowed)

    def _first_finish(self, seq: Sequence, token: int) -> str | None:
        """Why a sequence ends on its first token `token` (None: it goes on)."""
        p = seq.params
        if token in self._stops(p) and p.min_tokens <= 1:
            return "stop"
        return "length" if p.max_tokens == 1 else None

    def _stops(self, p: SamplingParams) -> frozenset[int]:
        eos = self._eos
        if not p.stop_token_ids:     # runs for every token: no set building in the common case
            return frozenset() if p.ignore_eos else eos
        return frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else eos)

    # ---- n > 1: forks share the prompt's blocks -------------------------------------------------
    def _child(self, parent: Sequence, index: int) -> Sequence:
        """Sequence `index` of parent's request: the same prompt, its own sampler and grammar state."""
        p = parent.params
        child = Sequence(parent.request_id, parent.prompt, p, make_generator(p, index), arrival=parent.arrival)
        child.index, child.cached_tokens, child.chain = index, parent.cached_tokens, list(parent.chain)
        child.scheduled = True                   # its queue time is its parent's
        child.guide = self.guides.guide(p.guide) if p.guide else None
        return child

    def _attach(self, parent: Sequence, child: Sequence) -> None:
        """Fork `child` off `parent`'s cache: full blocks are shared (refcount + 1), the partly
        written last block and the state slot are copied. Without a free slot or block, the
        child waits and recomputes its tokens like a preempted request."""
        group = self.groups.setdefault(parent.request_id, [parent])
        group.append(child)
        if not self.kv.fork(parent, child):
            self.scheduler.add(child)
            return
        full = parent.num_computed // self.config.block_tokens
        child.num_computed, child.hashed_blocks = parent.num_computed, min(parent.hashed_blocks, full)
        child.ring_from, child.keep_tokens = parent.ring_from, parent.keep_tokens
        child.status = Status.RUNNING
        self.scheduler.running.append(child)

    def _failure(self, seq: Sequence, error: Exception) -> RequestOutput:
        log.warning("request %s failed at admission: %s", seq.request_id, error)
        seq.finish_reason = "error"
        self.seqs.pop(seq.request_id, None)
        return dataclasses.replace(self._output(seq), error=f"{type(error).__name__}: {error}")

    def _append_token(self, seq: Sequence, token: int, logprob: float, top: list) -> None:
        p = seq.params
        stops = self._stops(p)
        seq.output.append(token)
        seq.logprobs.append(logprob)
        seq.top_logprobs.append(top)
        self.counters.generated_tokens += 1
        if seq.guide is not None:
            seq.guide.accept(token)
        if token in stops and len(seq.output) >= p.min_tokens:
            seq.finish_reason = "stop"
        elif seq.guide is not None and seq.guide.done:
            seq.finish_reason = "stop"
        elif len(seq.output) >= p.max_tokens:
            seq.finish_reason = "length"
        if seq.hold_kv and (not seq.finish_reason or any(sib[3] is None for sib in seq.siblings)):
            seq.first_finish, seq.finish_reason = seq.finish_reason, "held"
            self.counters.cached_tokens += seq.cached_tokens
            self.scheduler.detach(seq)
            seq.status = Status.HELD
            self.held[seq.request_id] = seq
            self.seqs.pop(seq.request_id, None)
            self.groups.pop(seq.request_id, None)
        elif seq.finish_reason:
            self.prefix.on_finish(seq)
            self.counters.cached_tokens += seq.cached_tokens if seq.index == 0 else 0
            self.scheduler.finish(seq)
            if self._group_finished(seq.request_id):
                self.seqs.pop(seq.request_id, None)
                self.groups.pop(seq.request_id, None)

    def _group_finished(self, request_id: str) -> bool:
        group = self.groups.get(request_id)
        if group is None:
            return True
        return len(group) == group[0].params.n and all(s.status == Status.FINISHED for s in group)

    def _output(self, seq: Sequence) -> RequestOutput:
        new = seq.output[seq.emitted:]
        seq.emitted = len(seq.output)
        finished = seq.status in (Status.FINISHED, Status.HELD)
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt, token_ids=list(seq.output),
            new_token_ids=new, logprobs=list(seq.logprobs),
            text=self.tokenizer.decode(seq.output) if finished else "",
            finished=finished, finish_reason=seq.finish_reason,
            prompt_tokens=len(seq.prompt), cached_tokens=seq.cached_tokens, index=seq.index,
            top_logprobs=seq.top_logprobs[len(seq.top_logprobs) - len(new):] if new else [],
            all_finished=finished and self._group_finished(seq.request_id),
            prompt_logprobs=[None] + seq.prompt_lps if seq.params.prompt_logprobs is not None and
            seq.resume is None and seq.index == 0 and (finished or len(seq.output) == len(new)) else None,
            siblings=list(seq.siblings) if seq.hold_kv else [], first_finish=seq.first_finish,
            held=seq.status == Status.HELD)

    # ---- convenience ------------------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams]
                 ) -> list[RequestOutput]:
        """Run all prompts concurrently to completion; results in input order (a request
        with n > 1 gives its n outputs one after another, by index)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"gen-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p)
        final: dict[tuple[str, int], RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id, out.index] = out
        return [final[r, i] for r, p in zip(ids, params_list) for i in range(p.n)]
