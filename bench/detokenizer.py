"""Time per token of the incremental detokenizer: the Python prefix/read-offset windows through
`decode` against `tokenizers`' DecodeStream (cluster/chat/detokenizer.py).

    python bench/detokenizer.py [--tokens 2000] [--repeats 20] [--markup]

The default model's tokenizer (byte-level BPE, as DeepSeek's) encodes a mixed text (English,
code, accented Latin, CJK, emoji) cut to --tokens tokens, with one stop string whose only
occurrence is at the end; each Detokenizer is fed one token per `add`, as a decode step streams
them, then `finish()`. Both must give the same deltas (checked). Prints the median and the best of
--repeats runs per token for each; --markup times decode_markup's path (V4's chat format).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvmesh.cluster.chat.detokenizer import Detokenizer  # noqa: E402
from kvmesh.workers.checkpoint.default_model import default_model_dir  # noqa: E402
from kvmesh.workers.checkpoint.tokenizer import load_tokenizer  # noqa: E402

PIECES = ["The weather in Beijing is sunny, 22°C, with a light breeze from the north. ",
          "def add(a: int, b: int) -> int:\n    return a + b  # sums two numbers\n\n",
          "Naïve café owners façade résumé — déjà vu. ",
          "北京今天天气晴朗，气温二十二度。我们明天去长城吧！",
          "Emoji: 🙂👍🏽🚀✨ and symbols Ω≈ç√∫. ",
          "{\"city\": \"Paris\", \"temperature\": [18, 21.5, null], \"ok\": true}\n"]
STOP = "<<END OF ANSWER>>"


def feed(tok, ids: list[int], markup: bool, stream: bool) -> tuple[float, list[str]]:
    decode = tok.decode_markup if markup else tok.decode
    start = time.perf_counter()
    d = Detokenizer(decode, [STOP], tok.decode_stream(markup=markup) if stream else None)
    deltas = [d.add([t]) for t in ids]
    deltas.append(d.finish())
    return time.perf_counter() - start, deltas


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--markup", action="store_true")
    args = ap.parse_args()
    tok = load_tokenizer(default_model_dir())
    text, i = "", 0
    while len(tok.encode_rendered(text)) < args.tokens:
        text += PIECES[i % len(PIECES)]
        i += 1
    body = tok.encode_rendered(text)
    stop = tok.encode_rendered(STOP)
    ids = body[:args.tokens - len(stop)] + stop
    times: dict[str, list[float]] = {"decode windows (Python)": [], "DecodeStream": []}
    for _ in range(args.repeats):                 # alternated, so drift hits both alike
        t_old, old = feed(tok, ids, args.markup, stream=False)
        t_new, new = feed(tok, ids, args.markup, stream=True)
        assert new == old, "the two paths' deltas differ"
        times["decode windows (Python)"].append(t_old)
        times["DecodeStream"].append(t_new)
    print(f"{len(ids)} tokens ({len(text)} chars of mixed text), one per add, stop string at the end; "
          f"{'decode_markup' if args.markup else 'decode'}; {args.repeats} runs; load {os.getloadavg()[0]:.2f}")
    for name, ts in times.items():
        print(f"  {name:24s} median {statistics.median(ts) / len(ids) * 1e6:6.2f} us/token, "
              f"best {min(ts) / len(ids) * 1e6:6.2f} us/token")


if __name__ == "__main__":
    main()
