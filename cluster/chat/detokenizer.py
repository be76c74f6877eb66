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

    `stream` (a tokenizer's `decode_stream()`, e.g. `tokenizers`' DecodeStream for a
    tokenizer.json; vLLM's fast detokenizer uses it) does that windowed decode natively:
    `step(ids)` returns the new text, or None while there is none or it ends mid-character. Its
    step is this class's algorithm over the same windows, so the text is the same; the offsets
    are kept here either way (`finish` decodes the undecided tail with `decode`). One case it
    cannot follow: a window whose text does not begin with its prefix's text (ByteFallback
    turns a byte token that completed a character into U+FFFD once an invalid byte follows it in
    the same run). DecodeStream raises there, and from then on `decode` does the work at the
    same offsets, so the text stays what it was. (Only where such a window is no longer in
    UTF-8 bytes but longer in characters than its prefix could the two differ without a raise:
    DecodeStream measures bytes, `decode`'s path characters, which agree whenever one text
    extends the other.)
    """

    def __init__(self, decode, stops: list[str], stream=None):
        self.decode, self.stops, self._stream = decode, [s for s in stops if s], stream
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
        self._full += self._decode_new(token_ids)
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

    def _decode_new(self, token_ids: list[int]) -> str:
        """Text the tokens since the last commit add, once it no longer ends mid-character."""
        if self._stream is not None:
            try:
                new = self._stream(token_ids)
            except Exception:        # the window's text does not extend its prefix's: decode below
                self._stream = None
            else:
                if new is None:
                    return ""
                self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
                return new
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
