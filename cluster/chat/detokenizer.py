"""Incremental detokenization with stop strings."""
from __future__ import annotations

REPLACEMENT = "\ufffd"   # what a decoder emits for an incomplete UTF-8 sequence


class Detokenizer:
    """Turns a growing token list into text deltas that never change once sent.

    Held back until more tokens arrive: a trailing incomplete UTF-8 sequence, and any
    tail that could still become a stop string. When a stop string appears, the text
    ends just before it and `stopped` is set; `finish()` releases what was held back.

    Incremental: each `add` decodes only the new tokens plus a few of context (vLLM's
    prefix/read offsets) and searches for stop strings only in the text that could
    newly contain one, so a long output costs linear, not quadratic, time.
    """

    def __init__(self, decode, stops: list[str]):
        self.decode, self.stops = decode, [s for s in stops if s]
        self.token_ids: list[int] = []
        self.stopped = False
        self._full = ""          # text of token_ids[:read_offset] (+ undecided tail kept out)
        self._sent = 0           # chars of _full already sent
        self._prefix_offset = self._read_offset = 0
        self._longest = max((len(s) for s in self.stops), default=0)

    @property
    def text(self) -> str:
        """Everything sent so far."""
        return self._full[:self._sent]

    def add(self, token_ids: list[int]) -> str:
        self.token_ids += token_ids
        self._full += self._decode_new()
        cut = self._stop_at()
        if cut is not None:
            self.stopped = True
            return self._send(cut)
        return self._send(len(self._full) - self._partial_stop())

    def finish(self) -> str:
        if self.stopped:
            return ""
        self._full += self._undecided()
        self._prefix_offset = self._read_offset = len(self.token_ids)
        cut = self._stop_at()
        self.stopped = cut is not None
        return self._send(len(self._full) if cut is None else cut)

    def _decode_new(self) -> str:
        """Text the tokens since the last commit add, once it no longer ends mid-character."""
        prefix = self.decode(self.token_ids[self._prefix_offset:self._read_offset])
        new = self.decode(self.token_ids[self._prefix_offset:])
        if len(new) > len(prefix) and not new.endswith(REPLACEMENT):
            self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
            return new[len(prefix):]
        return ""

    def _undecided(self) -> str:
        prefix = self.decode(self.token_ids[self._prefix_offset:self._read_offset])
        return self.decode(self.token_ids[self._prefix_offset:])[len(prefix):]

    def _send(self, upto: int) -> str:
        upto = max(upto, self._sent)
        delta = self._full[self._sent:upto]
        self._sent = upto
        return delta

    def _stop_at(self) -> int | None:
        start = max(0, self._sent - self._longest)
        hits = [i for i in (self._full.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _partial_stop(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        tail = self._full[-self._longest:] if self._longest else ""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(tail)), best, -1):
                if tail.endswith(s[:k]):
                    best = k
                    break
        return best
