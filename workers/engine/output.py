"""From a step's logits to what a request sees: sampling calls, stop checks, finishing (or
holding for a handoff), n > 1 forks, prompt logprobs and `RequestOutput`s.

The engine's loop hands each step's logits here (`sample`, `speculated`); everything a
sequence's end changes — the scheduler's lists, the request table, the prefix cache's
end-of-output checkpoint — changes here, on the engine thread, in that order.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from kvmesh.workers.request import FirstToken, RequestOutput, Sequence, Status
from kvmesh.workers.reuse.prefix_cache import PrefixCache
from kvmesh.workers.sampling.params import SamplingParams, make_generator
from kvmesh.workers.sampling.sampler import SampleRow, sample_batch
from kvmesh.workers.spec.speculative import Speculator

from .scheduler import Scheduler
from .stats import EngineCounters

log = logging.getLogger(__name__)


def check_stop(seq: Sequence, token: int, stops: frozenset[int]) -> str | None:
    """Why `seq` ends now that `token` is its last output token (None: it goes on)."""
    p = seq.params
    if token in stops and len(seq.output) >= p.min_tokens:
        return "stop"
    if seq.guide is not None and seq.guide.done:
        return "stop"
    return "length" if len(seq.output) >= p.max_tokens else None


@dataclass
class RequestTable:
    """The engine's live requests: `seqs` by id (sequence 0 of an n > 1 request), `groups`
    (every sequence of an n > 1 request, index order), `held` (prefilled, waiting for a handoff)."""
    seqs: dict[str, Sequence] = field(default_factory=dict)
    groups: dict[str, list[Sequence]] = field(default_factory=dict)
    held: dict[str, Sequence] = field(default_factory=dict)

    def group_finished(self, request_id: str) -> bool:
        group = self.groups.get(request_id)
        if group is None:
            return True
        return len(group) == group[0].params.n and all(s.status == Status.FINISHED for s in group)

    def drop(self, request_id: str) -> None:
        self.seqs.pop(request_id, None)
        self.groups.pop(request_id, None)


class OutputProcessor:
    def __init__(self, tokenizer, eos: frozenset[int], table: RequestTable,
                 scheduler: Scheduler, prefix: PrefixCache, counters: EngineCounters):
        self.tokenizer, self.eos, self.table = tokenizer, eos, table
        self.scheduler, self.prefix, self.counters = scheduler, prefix, counters

    # ---- sampling -------------------------------------------------------------------------
    def sample(self, batch, logits: torch.Tensor, sampled: list[int], at: list[int] | None = None
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
                    seqs.append(self.child(seq, i))
                    rows.append(row)
                    born.add(id(seqs[-1]))
        if not seqs:
            return []
        picked = list(zip(seqs, *sample_batch(logits[rows], [self.sample_row(s) for s in seqs])))
        held_forks = set()
        for s, token, logprob, top in picked:
            if id(s) in born:
                parent = self.table.seqs[s.request_id]
                if parent.hold_kv:      # prefill role: the forks happen on the decode worker
                    parent.siblings.append(FirstToken(token, logprob, tuple(top), self.first_finish(s, token),
                                                      s.index))
                    held_forks.add(id(s))
                else:
                    self.attach(parent, s)
        outputs = []
        for s, token, logprob, top in picked:
            if id(s) not in held_forks:
                self.append(s, token, logprob, top)
                outputs.append(self.output(s))
        return outputs

    def speculated(self, batch, logits: torch.Tensor, sampled: list[int], drafts: dict[int, list[int]],
                   saved, speculator: Speculator) -> list[RequestOutput]:
        """Rows of a drafted sequence are sampled one by one until a draft token is rejected."""
        plain, plain_rows, accepted, outputs, row = [], [], {}, [], 0
        for b in sampled:
            seq, draft = batch[b][0], drafts.get(b, [])
            if draft:
                rows = logits[row:row + 1 + len(draft)]
                accepted[b] = Speculator.accept(rows, draft, self._drawer(seq, rows))
                outputs.append(self.output(seq))
            else:
                plain.append(b)
                plain_rows.append(row)
            row += 1 + len(draft)
        # restore rejected rows before forks of the plain sequences can take a slot freed above
        speculator.settle(batch, drafts, accepted, saved)
        outputs += self.sample(batch, logits, plain, plain_rows)
        self.counters.draft_tokens += sum(len(d) for d in drafts.values())
        self.counters.accepted_draft_tokens += sum(accepted.values())
        self.counters.drafted_steps += sum(1 for d in drafts.values() if d)
        for b, n_ok in accepted.items():
            seq = batch[b][0]
            if n_ok and not seq.finish_reason:
                self.prefix.after_step(seq)
        return outputs

    def _drawer(self, seq: Sequence, rows: torch.Tensor):
        """How a drafted sequence's rows are sampled one by one (`Speculator.accept`): a greedy
        sequence whose sampling carries no state from token to token (no penalties, grammar or
        min_tokens ban) has every row picked in one call up front, the others row by row.
        A guided one's mask is filled as each row is drawn, not for every draft position up
        front as vLLM does: a draft position past the first refused token is never sampled, and
        on the default model ~10% of a forced tool call's drafts are accepted, so filling every
        position made the grammar's mask time 1.8x (bench/tool_call.py, docs/benchmarks.md
        "Guided decoding: one packed bitmask per step")."""
        p = seq.params
        if p.temperature > 0 or p.penalized or seq.guide is not None or len(seq.output) < p.min_tokens:
            return lambda x: self._draw(seq, x)
        picked = iter(zip(*sample_batch(rows, [self.sample_row(seq)] * rows.shape[0])))

        def take(_: torch.Tensor) -> int | None:
            token, logprob, top = next(picked)
            self.append(seq, token, logprob, top)
            return None if seq.finish_reason else token
        return take

    def _draw(self, seq: Sequence, logits: torch.Tensor) -> int | None:
        """Sample and append one token from one row; returns it, or None once seq has finished."""
        token, logprob, top = (x[0] for x in sample_batch(logits[None], [self.sample_row(seq)]))
        self.append(seq, token, logprob, top)
        return None if seq.finish_reason else token

    def prompt_logprobs(self, batch, logits: torch.Tensor, extra: list[tuple[int, int]]) -> None:
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

    def sample_row(self, seq: Sequence) -> SampleRow:
        p = seq.params
        stops = self.stops(p)
        banned = tuple(stops) if len(seq.output) < p.min_tokens else ()
        return SampleRow(p, seq.generator, banned, seq.prompt if p.penalized else [],
                         seq.output if p.penalized else [], seq.guide)

    # ---- stops and finishing ----------------------------------------------------------------
    def stops(self, p: SamplingParams) -> frozenset[int]:
        eos = self.eos
        if not p.stop_token_ids:     # runs for every token: no set building in the common case
            return frozenset() if p.ignore_eos else eos
        return frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else eos)

    def first_finish(self, seq: Sequence, token: int) -> str | None:
        """Why a sequence ends on its first token `token` (None: it goes on)."""
        p = seq.params
        if token in self.stops(p) and p.min_tokens <= 1:
            return "stop"
        return "length" if p.max_tokens == 1 else None

    def append(self, seq: Sequence, token: int, logprob: float, top: list) -> None:
        """Append one sampled token; a sequence that ends here is finished, or held for its
        handoff (prefill role: after the first token)."""
        seq.output.append(token)
        seq.logprobs.append(logprob)
        seq.top_logprobs.append(top)
        self.counters.generated_tokens += 1
        if seq.guide is not None:
            seq.guide.accept(token)
        seq.finish_reason = check_stop(seq, token, self.stops(seq.params))
        if seq.hold_kv and (not seq.finish_reason or any(sib.finish is None for sib in seq.siblings)):
            self._hold(seq)
        elif seq.finish_reason:
            self.prefix.on_finish(seq)
            self.counters.cached_tokens += seq.cached_tokens if seq.index == 0 else 0
            self.scheduler.finish(seq)
            if self.table.group_finished(seq.request_id):
                self.table.drop(seq.request_id)

    def _hold(self, seq: Sequence) -> None:
        seq.first_finish, seq.finish_reason = seq.finish_reason, "held"
        self.counters.cached_tokens += seq.cached_tokens
        self.scheduler.detach(seq)
        seq.status = Status.HELD
        self.table.held[seq.request_id] = seq
        self.table.drop(seq.request_id)

    def failure(self, seq: Sequence, error: Exception) -> RequestOutput:
        log.warning("request %s failed at admission: %s", seq.request_id, error)
        seq.finish_reason = "error"
        self.table.seqs.pop(seq.request_id, None)
        return dataclasses.replace(self.output(seq), error=f"{type(error).__name__}: {error}")

    # ---- n > 1: forks share the prompt's blocks -------------------------------------------------
    def child(self, parent: Sequence, index: int) -> Sequence:
        """Sequence `index` of parent's request: the same prompt, its own sampler and grammar state."""
        p = parent.params
        child = Sequence(parent.request_id, parent.prompt, p, make_generator(p, index), arrival=parent.arrival)
        child.index, child.cached_tokens, child.chain = index, parent.cached_tokens, list(parent.chain)
        child.scheduled = True                   # its queue time is its parent's
        child.guide = parent.guide.fresh() if parent.guide is not None else None
        return child

    def attach(self, parent: Sequence, child: Sequence) -> None:
        self.table.groups.setdefault(parent.request_id, [parent]).append(child)
        self.scheduler.fork(parent, child)

    # ---- what the request sees ----------------------------------------------------------------
    def output(self, seq: Sequence) -> RequestOutput:
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
            all_finished=finished and self.table.group_finished(seq.request_id),
            prompt_logprobs=[None] + seq.prompt_lps if seq.params.prompt_logprobs is not None and
            seq.resume is None and seq.index == 0 and (finished or len(seq.output) == len(new)) else None,
            first=self.first_token(seq), siblings=list(seq.siblings) if seq.hold_kv else [],
            held=seq.status == Status.HELD)

    @staticmethod
    def first_token(seq: Sequence) -> FirstToken | None:
        """Prefill role: sequence 0's first token, ended there or not (held: the reason it had)."""
        if not seq.hold_kv or not seq.output:
            return None
        finish = seq.first_finish if seq.status == Status.HELD else seq.finish_reason
        return FirstToken(seq.output[0], seq.logprobs[0], tuple(seq.top_logprobs[0]), finish)
