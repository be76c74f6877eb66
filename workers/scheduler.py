"""Continuous batching under a token budget: decodes first, then prefill chunks.

Each step the scheduler returns `[(seq, n_tokens)]`: every running sequence that is
decoding gets 1 token, then running prefills and newly admitted requests share what is
left of the budget (chunked prefill). Memory is blocks + one state slot per running
request; when a decode cannot get a block, the newest running request is preempted
(its cache freed, re-run later from its tokens) so the process never dies of it.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from kvstore.block_pool import BlockPool
from kvstore.state_slots import SlotPool

from .sequence import Sequence, Status


class Scheduler:
    def __init__(self, blocks: BlockPool, slots: SlotPool, block_tokens: int, max_num_seqs: int,
                 max_batched_tokens: int, on_admit: Callable[[Sequence], bool] | None = None,
                 cut: Callable[[Sequence, int], int | None] | None = None):
        self.blocks, self.slots, self.block_tokens = blocks, slots, block_tokens
        self.cut = cut
        self.max_num_seqs, self.max_batched_tokens = max_num_seqs, max_batched_tokens
        self.on_admit = on_admit
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.failed: list[tuple[Sequence, Exception]] = []   # admissions that raised; reported once
        self.preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def ensure_blocks(self, seq: Sequence, upto_tokens: int) -> bool:
        need = self.blocks_for(upto_tokens) - len(seq.blocks)
        if need > 0 and not self.blocks.can_allocate(need):
            return False
        for _ in range(max(need, 0)):
            seq.blocks.append(self.blocks.allocate())
        return True

    def free(self, seq: Sequence) -> None:
        for b in seq.blocks:
            self.blocks.release(b)
        seq.blocks = []
        seq.hashed_blocks = 0
        if seq.slot is not None:
            self.slots.release(seq.slot)
            seq.slot = None

    def finish(self, seq: Sequence) -> None:
        seq.status = Status.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.free(seq)

    def detach(self, seq: Sequence) -> None:
        """Stop scheduling `seq` but keep its blocks and slot (held for a handoff)."""
        self.running.remove(seq)
        seq.status = Status.FINISHED

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.free(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def chunk(self, seq: Sequence, budget: int) -> int:
        """Prefill tokens for seq this step: budget-bound, ending at a checkpoint cut if any."""
        n = min(seq.remaining_prefill(), budget)
        cut = self.cut(seq, seq.num_computed) if self.cut else None
        return min(n, cut - seq.num_computed) if cut is not None and cut > seq.num_computed else n

    def schedule(self) -> list[tuple[Sequence, int]]:
        budget = self.max_batched_tokens
        batch: list[tuple[Sequence, int]] = []
        for seq in list(self.running):
            if seq.remaining_prefill() != 1 or seq not in self.running:
                continue
            while not self.ensure_blocks(seq, seq.num_computed + 1):
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
                if not self.ensure_blocks(seq, seq.num_computed + n):
                    break
                batch.append((seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and self.slots.num_free:
            seq = self.waiting[0]
            seq.slot = self.slots.allocate()
            try:
                admitted = self.on_admit(seq) if self.on_admit else True
            except Exception as e:  # this request cannot start (e.g. its handed-off cache failed to load)
                self.waiting.popleft()
                self.finish(seq)
                self.failed.append((seq, e))
                continue
            if not admitted:
                self.free(seq)
                break
            n = self.chunk(seq, budget)
            if not self.ensure_blocks(seq, seq.num_computed + n):
                self.free(seq)
                seq.num_computed = seq.cached_tokens = 0
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.append((seq, n))
            budget -= n
        return batch
