"""Continuous batching under a token budget: decodes first, then prefill chunks.

Each step the scheduler returns `[(seq, n_tokens)]`: every running sequence that is
decoding gets 1 token, then running prefills and newly admitted requests share what is
left of the budget (chunked prefill). Memory (blocks + one state slot per running
request) comes from the KV-cache manager alone; when a decode cannot get a block, the
newest running request is preempted (its cache freed, re-run later from its tokens) so
the process never dies of it. A decode-role request whose handed-off cache the manager reads
off the step (`loads_in_flight`) waits in `loading`, its memory reserved, and joins the running
requests at the first step after its load ended (or fails alone); so does a request whose prefix
hit is copied into its blocks off the step because others are running.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, NamedTuple

from kvmesh.workers.request import Sequence, Status

from .kv_manager import KVCacheManager, KVLoadError


class Scheduled(NamedTuple):
    batch: list[tuple[Sequence, int]]             # (sequence, tokens to run this step)
    failed: list[tuple[Sequence, KVLoadError]]     # requests that could not start (finished, freed)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_batched_tokens: int,
                 on_admit: Callable[[Sequence], None] | None = None):
        """`on_admit(seq)` runs once seq holds its cache, before it joins the running list."""
        self.kv = kv
        self.max_num_seqs, self.max_batched_tokens = max_num_seqs, max_batched_tokens
        self.on_admit = on_admit
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.loading: list[Sequence] = []          # admitted, their cache being read / written off the step
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def has_batch(self) -> bool:
        """Something could run in the next step (not only loads in flight)."""
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        if seq in self.loading:                # its memory comes back once the load is over
            self.loading.remove(seq)
            self.kv.abandon(seq)
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)

    def detach(self, seq: Sequence) -> None:
        """Stop scheduling `seq` but keep its blocks and slot (held for a handoff)."""
        self.running.remove(seq)
        seq.status = Status.FINISHED

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Run `child`, a new sequence of parent's request (n > 1), from parent's cache: full
        blocks shared, the partly written last block and the state slot copied. Without a free
        slot or block the child waits and recomputes its tokens like a preempted request."""
        if not self.kv.fork(parent, child):
            self.add(child)
            return
        full = parent.num_computed // self.kv.block_tokens
        child.num_computed, child.hashed_blocks = parent.num_computed, min(parent.hashed_blocks, full)
        child.ring_from, child.keep_tokens = parent.ring_from, parent.keep_tokens
        child.status = Status.RUNNING
        self.running.append(child)

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def chunk(self, seq: Sequence, budget: int, start: int | None = None) -> int:
        """Prefill tokens for seq this step from `start` (default: what it has computed):
        budget-bound, ending at a checkpoint cut if any."""
        start = seq.num_computed if start is None else start
        n = min(seq.length - start, budget)
        cut = self.kv.cut(seq, start)
        return min(n, cut - start) if cut is not None and cut > start else n

    def schedule(self) -> Scheduled:
        self.kv.reap_landing()
        budget = self.max_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        failed: list[tuple[Sequence, KVLoadError]] = []
        for seq, error in self.kv.loaded():       # caches read / written off the step: in, or failed
            self.loading.remove(seq)
            if error is not None:
                seq.status = Status.FINISHED
                failed.append((seq, error))
                continue
            if self.on_admit is not None:
                self.on_admit(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
        for seq in list(self.running):
            if seq.remaining_prefill() != 1 or seq not in self.running:
                continue
            while not self.kv.allocate_slots(seq, 1):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq in self.running:
                batch.append((seq, 1))
                budget -= 1
        for seq in self.running:
            if budget <= 0:
                break
            if seq.remaining_prefill() > 1:
                n = self.chunk(seq, budget)
                if not self.kv.allocate_slots(seq, n):
                    break
                batch.append((seq, n))
                budget -= n
        while (self.waiting and budget > 0 and len(self.running) + len(self.loading) < self.max_num_seqs
               and self.kv.can_admit):
            seq = self.waiting[0]
            hit = self.kv.get_computed_blocks(seq)
            try:
                admitted = self.kv.allocate_slots(seq, self.chunk(seq, budget, hit.num_tokens), hit,
                                                  off_step=bool(self.running))
            except KVLoadError as e:      # its handed-off cache failed to load: only it fails
                self.waiting.popleft()
                self.finish(seq)
                failed.append((seq, e))
                continue
            if not admitted:
                break
            if self.kv.is_loading(seq):          # its cache is written off the step: it joins when that ends
                self.waiting.popleft()
                self.loading.append(seq)
                continue
            if self.on_admit is not None:
                self.on_admit(seq)
            n = self.chunk(seq, budget)    # from the hit (or from 0 when it could not be written)
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
        return Scheduled(batch, failed)
