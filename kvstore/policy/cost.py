"""The SWA-policy cost model: replays a request trace against a model of the shared store.

For each request, in arrival order, it does what an engine with that policy does, using
the same pure pieces (`plan_restore`, `checkpoint_due`, `branch_point`):

    lookup   leading blocks present in the store (chain of hash ids), checkpoints among them
    plan     `plan_restore` -> blocks + checkpoint loaded, tokens recomputed, tokens computed
    persist  every full block not yet stored; checkpoints where `checkpoint_due` (periodic,
             auto) and at the branch point (auto); each put evicts to the capacity
             (LRU; `unread_first`: objects never read since written go first)

Sizes come from the layout (tensor payload per object; object headers, < 1 KiB each, are
not counted), times from `Hardware`:

    TTFT(request) = overhead_s + (steps - 1) * step_s + computed_tokens / prefill_tokens_per_s + bytes_loaded / read_bps

(`steps`: the forward passes the prompt takes, chunked at `chunk_tokens` and cut at every
checkpoint it writes; `overhead_s` and `step_s` matter only on tiny models, where fixed
costs dominate, and are 0 in projections.)

so `ttft_saved_s` = Σ (cold TTFT - TTFT). The model is the store tier alone: an engine's
device and host tiers hold a subset of the store, so with no capacity limit its hits are
exactly the model's (the replay test pins that). No torch: it runs at V4 scale in seconds.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, NamedTuple

from kvmesh.kvstore.device.layout import CSA, HCA, SWA, CacheLayout, LayoutParams
from kvmesh.kvstore.policy.planner import (Availability, SwaPolicy, branch_point, checkpoint_due, plan_restore,
                      recompute_span)
from kvmesh.kvstore.policy.trace import TraceRequest


# The released shapes (cache-relevant fields only). V4-Pro: 61 layers, 30 CSA + 31 HCA,
# window 128, head_dim 512, index_head_dim 128 (DESIGN §1, 9,848 B/token). V4-Flash: 43
# layers, the first two sliding-window only, then CSA and HCA alternating (21 + 20), same
# dims (DeepSeek-V4-Flash config as summarised by antirez/ds4 MODEL_CARD.md and ds4.c:
# DS4_N_LAYER 43, head dim 512, indexer head dim 128, window 128).
V4_SHAPES = {   # BF16 compute; rope_dim 64 (qk_rope_head_dim), kept in BF16 under the FP8 KV cache
    "V4-Pro": LayoutParams((HCA,) + (CSA, HCA) * 30, 512, 128, 4, 128, 128, rope_dim=64),
    "V4-Flash": LayoutParams((SWA, SWA) + (CSA, HCA) * 20 + (CSA,), 512, 128, 4, 128, 128, rope_dim=64),
}


@dataclass(frozen=True)
class Hardware:
    """A deployment's figures (measured, or stated for a projection)."""
    prefill_tokens_per_s: float
    store_read_bps: float            # bytes/s a restore reads from the store
    store_write_bps: float           # bytes/s the store absorbs
    capacity_bytes: int | None = None
    overhead_s: float = 0.0          # per request, whatever its length
    step_s: float = 0.0              # per forward step after the first (chunks cut at checkpoints)


class ObjectSizes(NamedTuple):
    block: int                       # tensor bytes of one block object under the policy
    checkpoint: int                  # tensor bytes of one checkpoint (state at a block boundary)


def object_sizes(layout: CacheLayout, policy: SwaPolicy) -> ObjectSizes:
    """What one stored object carries: a block's compressed entries (+ its SWA K=V and
    end-of-block overlap state under `full`); a checkpoint's SWA rings + CSA overlap state."""
    return ObjectSizes(layout.resident_block_bytes(policy.kind == "full"), layout.checkpoint_bytes)


def layout_span(layout: CacheLayout) -> int:
    """Tokens the zero policy reruns before a hit (as the engine computes it)."""
    ratios = [s.ratio for s in layout.specs if s.ratio] or [1]
    return recompute_span(len(layout.specs), layout.params.window, max(ratios))


class RequestCost(NamedTuple):
    tokens: int
    hit_tokens: int                  # prompt tokens restored
    recompute_tokens: int            # tokens rerun before the hit (zero policy)
    computed_tokens: int             # tokens the request runs: prompt - hit + recompute
    bytes_loaded: int
    bytes_written: int
    checkpoints_written: int
    steps: int


class StoreModel:
    """The shared store: objects by (kind, prefix node), capacity-bound with the store's
    eviction: LRU, or (`unread_first`) objects never read since written first, then LRU."""

    def __init__(self, capacity: int | None = None, unread_first: bool = False):
        self.capacity, self.unread_first = capacity, unread_first
        self.fresh: OrderedDict = OrderedDict()      # key -> size; never read (unread_first only)
        self.objects: OrderedDict = OrderedDict()    # key -> size, LRU first
        self.bytes = self.evicted = 0

    def __contains__(self, key) -> bool:
        return key in self.objects or key in self.fresh

    def read(self, key) -> int:
        if key in self.fresh:
            self.objects[key] = self.fresh.pop(key)
        self.objects.move_to_end(key)
        return self.objects[key]

    def put(self, key, size: int) -> None:
        if self.capacity is not None and size > self.capacity:
            return
        (self.fresh if self.unread_first else self.objects)[key] = size
        self.bytes += size
        while self.capacity is not None and self.bytes > self.capacity:
            self.bytes -= (self.fresh or self.objects).popitem(last=False)[1]
            self.evicted += 1

    def keys(self) -> list:
        return list(self.fresh) + list(self.objects)


class Simulator:
    """One policy over a stream of requests (the store persists across `run` calls)."""

    def __init__(self, layout: CacheLayout, policy: SwaPolicy, capacity_bytes: int | None = None,
                 chunk_tokens: int | None = None, unread_first: bool = False):
        self.layout, self.policy, self.bt, self.chunk = layout, policy, layout.block_tokens, chunk_tokens
        self.sizes, self.span = object_sizes(layout, policy), layout_span(layout)
        self.store = StoreModel(capacity_bytes, unread_first)
        self._nodes: dict[tuple[int, int], int] = {}

    def nodes(self, blocks: tuple[int, ...]) -> list[int]:
        """A prefix node id per block: equal ids exactly where the hash-id prefixes are equal."""
        out, parent = [], -1
        for h in blocks:
            parent = self._nodes.setdefault((parent, h), len(self._nodes))
            out.append(parent)
        return out

    def request(self, req: TraceRequest, period: int | None = None) -> RequestCost:
        bt, policy, store = self.bt, self.policy, self.store
        full = req.tokens // bt
        nodes = self.nodes(req.blocks[:full])
        lookup = nodes[:(req.tokens - 1) // bt]
        n = 0
        while n < len(lookup) and ("block", lookup[n]) in store:
            n += 1
        ckpts = frozenset(i for i in range(n) if ("checkpoint", lookup[i]) in store) if policy.checkpoints \
            else frozenset()
        avail = Availability(n, ckpts)
        plan = plan_restore(req.tokens, bt, avail, policy, self.span)
        loaded = sum(store.read(("block", nodes[i])) for i in range(plan.load_blocks))
        if plan.checkpoint is not None:
            loaded += store.read(("checkpoint", nodes[plan.checkpoint]))
        written = ckpts_written = 0
        cuts = [req.tokens]
        for i in range(plan.load_blocks, full):
            if ("block", nodes[i]) not in store:
                store.put(("block", nodes[i]), self.sizes.block)
                written += self.sizes.block
        if policy.checkpoints:
            p = policy.period if period is None else period
            due = [pos for pos in range(plan.recompute_from + bt, full * bt + 1, bt)
                   if checkpoint_due(pos, req.tokens, bt, p)]
            branch = branch_point(plan, avail, bt, policy)
            cuts += [pos for pos in due + [req.tokens // bt * bt] + ([branch] if branch else [])
                     if pos > plan.recompute_from]
            for pos in sorted(set(due + ([branch] if branch else []))):
                key = ("checkpoint", nodes[pos // bt - 1])
                if key not in store:
                    store.put(key, self.sizes.checkpoint)
                    written += self.sizes.checkpoint
                    ckpts_written += 1
        computed = req.tokens - plan.recompute_from
        return RequestCost(req.tokens, plan.hit_tokens, plan.recompute_tokens, computed, loaded, written,
                           ckpts_written, self._steps(plan.recompute_from, cuts))

    def _steps(self, start: int, cuts: list[int]) -> int:
        steps = 0
        for end in sorted(set(cuts)):
            steps += -(-(end - start) // self.chunk) if self.chunk else 1
            start = end
        return steps


class PolicyOutcome(NamedTuple):
    policy: str
    requests: int
    prompt_tokens: int
    hit_tokens: int
    recompute_tokens: int
    computed_tokens: int
    bytes_stored: int                # in the store at the end (all written, when nothing was evicted)
    bytes_written: int
    bytes_loaded: int
    checkpoints_written: int
    evicted: int
    duration_s: float                # the trace's span of arrival times
    write_bps: float                 # bytes written / duration
    ttft_s: tuple[float, ...]        # per request
    cold_ttft_s: tuple[float, ...]
    periods: tuple[int, ...] = ()    # auto: the period in force at each re-evaluation

    @property
    def ttft_saved_s(self) -> float:
        return sum(self.cold_ttft_s) - sum(self.ttft_s)

    def as_json(self) -> dict:
        return {"policy": self.policy, "bytes_stored": self.bytes_stored, "write_gbps": self.write_bps / 1e9,
                "hit_tokens": self.hit_tokens, "recompute_tokens": self.recompute_tokens,
                "ttft_saved_s": self.ttft_saved_s}


def ttft(cost: RequestCost, hw: Hardware) -> float:
    return hw.overhead_s + (cost.steps - 1) * hw.step_s + cost.computed_tokens / hw.prefill_tokens_per_s + \
        cost.bytes_loaded / hw.store_read_bps


def cold_ttft(tokens: int, hw: Hardware, chunk_tokens: int | None = None) -> float:
    steps = -(-tokens // chunk_tokens) if chunk_tokens else 1
    return hw.overhead_s + (steps - 1) * hw.step_s + tokens / hw.prefill_tokens_per_s


def simulate(requests: list[TraceRequest], layout: CacheLayout, policy: SwaPolicy, hw: Hardware,
             tuner: "PeriodTuner | ScheduledPeriods | None" = None, chunk_tokens: int | None = None,
             unread_first: bool = False) -> PolicyOutcome:
    """Replay `requests` under `policy`; an adaptive auto policy re-chooses its period with
    `tuner` (default: `PeriodTuner(layout, hw)`) as it goes, from the requests seen so far."""
    sim = Simulator(layout, policy, hw.capacity_bytes, chunk_tokens, unread_first)
    if policy.kind == "auto" and policy.adaptive and tuner is None:
        tuner = PeriodTuner(layout, hw, every=256, window=256)
    period, periods, costs = policy.period, [], []
    for i, req in enumerate(requests):
        if tuner is not None and policy.adaptive:
            tuner.observe(req)
            if tuner.due():
                period = tuner.choose()
                periods.append(period)
        costs.append(sim.request(req, period))
    span = (requests[-1].t - requests[0].t) if len(requests) > 1 else 0.0
    written = sum(c.bytes_written for c in costs)
    return PolicyOutcome(
        str(policy), len(costs), sum(c.tokens for c in costs), sum(c.hit_tokens for c in costs),
        sum(c.recompute_tokens for c in costs), sum(c.computed_tokens for c in costs), sim.store.bytes, written,
        sum(c.bytes_loaded for c in costs), sum(c.checkpoints_written for c in costs), sim.store.evicted, span,
        written / span if span > 0 else 0.0, tuple(ttft(c, hw) for c in costs),
        tuple(cold_ttft(c.tokens, hw, chunk_tokens) for c in costs), tuple(periods))


class PeriodTuner:
    """Chooses auto's checkpoint period from the cost model, re-evaluated as requests arrive.

    Every `every` requests it replays the last `window` requests seen under auto with each
    candidate period (0 = prompt ends and branch points only) on the deployment's figures,
    drops candidates whose writes outrun the store's write bandwidth, and picks the one
    storing least among those whose total TTFT is within `tolerance` of the best."""

    def __init__(self, layout: CacheLayout, hw: Hardware, every: int = 64, window: int = 512,
                 tolerance: float = 0.02, max_period: int | None = None):
        self.layout, self.hw, self.every, self.window, self.tolerance = layout, hw, every, window, tolerance
        bt = layout.block_tokens
        top = max_period or 64 * bt
        self.candidates = [0] + [bt << k for k in range(top.bit_length()) if bt << k <= top]
        self.seen: list[TraceRequest] = []
        self.count = 0                   # requests observed
        self.period = 0

    def observe(self, req: TraceRequest) -> None:
        self.seen.append(req)
        self.count += 1
        if len(self.seen) > 2 * self.window:
            del self.seen[:-self.window]

    def due(self) -> bool:
        return self.count > 0 and self.count % self.every == 0

    def update_hardware(self, hw: Hardware) -> None:
        """New measured figures (prefill speed, store bandwidth) for the next choice."""
        self.hw = hw

    def choose(self) -> int:
        recent = self.seen[-self.window:]
        scored = []
        for p in self.candidates:
            out = simulate(recent, self.layout, SwaPolicy("auto", p), self.hw)
            if out.write_bps <= self.hw.store_write_bps or p == self.candidates[-1]:
                scored.append((sum(out.ttft_s), out.bytes_written, p))
        best = min(t for t, _, _ in scored)
        self.period = min((b, p) for t, b, p in scored if t <= best * (1 + self.tolerance))[1]
        return self.period


class ScheduledPeriods:
    """A tuner that replays the periods an engine chose ({requests seen: period}), so the
    model of an adaptive auto run is exact."""

    def __init__(self, choices: dict[int, int]):
        self.choices, self.seen = dict(choices), 0

    def observe(self, req: TraceRequest) -> None:
        self.seen += 1

    def due(self) -> bool:
        return self.seen in self.choices

    def choose(self) -> int:
        return self.choices[self.seen]


def policies_for(block_tokens: int, periods: Iterable[int]) -> list[SwaPolicy]:
    """The fixed policies a comparison runs, plus adaptive auto."""
    return ([SwaPolicy("full")] + [SwaPolicy("periodic", p) for p in periods] + [SwaPolicy("zero"),
            SwaPolicy("auto", 0, True)])
