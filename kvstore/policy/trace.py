"""Request traces with prefix structure (Mooncake's format) and their deterministic tokens.

One JSON object per line: `{"timestamp": ms, "input_length": tokens, "output_length":
tokens, "hash_ids": [...]}`; `hash_ids` name the prompt's blocks of `trace_block`
(512) tokens, the last one possibly partial. Two requests share a prefix exactly where
their `hash_ids` do.

A replay scales each trace block to `block_tokens` tokens (a 512-token block becomes
one 16-token block of a tiny model; at V4 scale `block_tokens = 512` keeps lengths as
they are) and makes each hash id a deterministic block of token ids, so equal ids give
equal tokens in every process:

    hash_ids   |   7    |   8    |  9 (partial) |
    tokens     | blk(7) | blk(8) | blk(9)[:r]   |     blk(h) = block_tokens ids seeded by h
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import NamedTuple

TRACE_BLOCK = 512


class TraceError(ValueError):
    """A trace file or line that cannot be replayed; the message names the line."""


class TraceRequest(NamedTuple):
    t: float                    # arrival, seconds from the trace's start
    blocks: tuple[int, ...]     # hash ids of the prompt's blocks (the last may be partial)
    tokens: int                 # prompt tokens after scaling
    output_tokens: int


def scaled_tokens(input_length: int, n_blocks: int, block_tokens: int, trace_block: int = TRACE_BLOCK) -> int:
    """Prompt length once every trace block is `block_tokens` long (the partial tail in
    proportion, at least one token)."""
    rest = input_length - trace_block * (n_blocks - 1)
    return (n_blocks - 1) * block_tokens + max(1, -(-rest * block_tokens // trace_block))


def parse_line(line: str, block_tokens: int, where: str, trace_block: int = TRACE_BLOCK) -> TraceRequest:
    try:
        raw = json.loads(line)
        ids, length = [int(h) for h in raw["hash_ids"]], int(raw["input_length"])
        t, out = float(raw.get("timestamp", 0)) / 1000.0, int(raw.get("output_length", 0))
    except (ValueError, KeyError, TypeError) as e:
        raise TraceError(f"{where}: not a trace request ({type(e).__name__}: {e})") from None
    if not ids or not trace_block * (len(ids) - 1) < length <= trace_block * len(ids):
        raise TraceError(f"{where}: input_length {length} does not fit {len(ids)} blocks of {trace_block}")
    return TraceRequest(t, tuple(ids), scaled_tokens(length, len(ids), block_tokens, trace_block), out)


def load_trace(path: str | Path, block_tokens: int, start: int = 0, limit: int | None = None,
               trace_block: int = TRACE_BLOCK) -> list[TraceRequest]:
    """Requests [start, start + limit) of a trace file, lengths scaled to `block_tokens`."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror or e}") from None
    stop = len(lines) if limit is None else start + limit
    return [parse_line(line, block_tokens, f"{path}:{i + 1}", trace_block)
            for i, line in enumerate(lines[start:stop], start) if line.strip()]


def sample_conversations(requests: list[TraceRequest], rate: int, key_block: int = 1) -> list[TraceRequest]:
    """About 1/`rate` of the requests, whole conversations at a time: those whose block
    `key_block` (the first after a shared system prompt) falls in one hash bucket. A
    window of consecutive requests keeps little of a trace's reuse (a conversation's turns
    are minutes apart); this keeps it (on the conversation trace: 41 % of prompt tokens
    hit at rate 40, 37 % in the whole trace)."""
    return [r for r in requests if len(r.blocks) > key_block and (r.blocks[key_block] * 2654435761) % rate == 0]


def block_token_ids(hash_id: int, block_tokens: int, vocab: int, low: int = 3) -> list[int]:
    """The deterministic tokens of one trace block (ids in [low, vocab))."""
    rng = random.Random(hash_id * 1_000_003 + block_tokens)
    return [rng.randrange(low, vocab) for _ in range(block_tokens)]


def prompt_token_ids(req: TraceRequest, block_tokens: int, vocab: int) -> list[int]:
    ids: list[int] = []
    for h in req.blocks:
        ids += block_token_ids(h, block_tokens, vocab)
    return ids[:req.tokens]
