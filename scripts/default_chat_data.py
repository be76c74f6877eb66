"""Synthetic conversations in DeepSeek-V4's chat format, made from the built-in model's corpus,
for the chat stage of `scripts/train_default_model.py` (rendered by kvmesh's own encoder,
`cluster/chat/dsv4_encode.py`, so the model learns exactly the prompts it is served with).

Tasks, each a user turn and the assistant's reply (thinking mode: a short reasoning first):

    Continue: {a sentence's first words}            -> the rest of the sentence
    Repeat after me: {sentence}                      -> the sentence
    Give me a verse about {word}.                    -> a sentence with the word
    Find {n} verse(s) about {word}.        (tools)   -> search_verses(query, limit), the result, a quote
    How many words are in: {sentence}      (tools)   -> count_words(text), the result, the count

A conversation is 1-3 turns in thinking or chat mode (earlier turns render as the encoder
renders them), or, with the tools offered, mostly one tool round trip whose tool result comes
from running the tool on the corpus here. Every draw comes from the seeded `random.Random` given.
"""
from __future__ import annotations

import json
import random
import re

from kvmesh.cluster.chat.dsv4_encode import (ASSISTANT, CHAT, DSML, END_THINK, LATEST_REMINDER, TASK_TOKENS, THINK, THINKING, USER,
                               encode_messages)

# V4's tokens the encoder writes as one id each (besides BOS / EOS), in the order they are added
V4_TOKENS = [USER, ASSISTANT, LATEST_REMINDER, THINK, END_THINK, DSML, *TASK_TOKENS.values()]
TOPICS = ["water", "light", "bread", "king", "land", "fire", "sea", "house", "gold", "wine", "sheep", "city",
          "mountain", "river", "sword", "temple", "heaven", "earth", "tree", "stone", "peace", "love", "people",
          "law", "prayer", "night", "day", "blood", "silver", "field", "son", "mother", "wilderness", "cloud"]
NUMBERS = {1: "one verse", 2: "two verses", 3: "three verses"}
TOOLS = [
    {"type": "function", "function": {
        "name": "search_verses", "description": "Find verses that contain a word",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "the word to look for"},
            "limit": {"type": "integer", "description": "how many verses", "minimum": 1, "maximum": 3}},
            "required": ["query", "limit"]}}},
    {"type": "function", "function": {
        "name": "count_words", "description": "Count the words of a text",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}},
]


def sentences(text: str, min_words: int = 5, max_words: int = 24) -> list[str]:
    """The corpus cut at sentence ends, kept when short enough to quote."""
    out = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text)]
    return [s for s in out if min_words <= len(s.split()) <= max_words and '"' not in s]


class Conversations:
    """Seeded conversations over `sents`: `next()` -> (messages, tools or None, mode)."""

    def __init__(self, sents: list[str], rng: random.Random):
        self.sents, self.rng = sents, rng
        words = {w: [] for w in TOPICS}
        for s in sents:
            for w in set(re.findall(r"[a-z]+", s.lower())) & words.keys():
                words[w].append(s)
        self.about = {w: v for w, v in words.items() if len(v) >= 3}
        if not self.about:
            raise ValueError("the corpus has no sentences about any topic word")

    def search_verses(self, query: str, limit: int) -> list[str]:
        return [s for s in self.about.get(query, []) if re.search(rf"\b{query}\b", s.lower())][:limit]

    @staticmethod
    def count_words(text: str) -> int:
        return len(text.split())

    def task(self) -> tuple[str, str, str]:
        """(user, reasoning, content) of one plain turn."""
        r, s = self.rng, self.rng.choice(self.sents)
        kind = r.choice(("continue", "repeat", "about"))
        if kind == "continue":
            words = s.split()
            k = r.randint(2, min(6, len(words) - 2))
            head, tail = " ".join(words[:k]), " ".join(words[k:])
            return f"Continue: {head}", f'The user gives the start of a verse: "{head}". I will finish it.', tail
        if kind == "repeat":
            return f"Repeat after me: {s}", "The user wants these words said back. I will repeat them.", s
        word = r.choice(sorted(self.about))
        return (f"Give me a verse about {word}.", f"The user asks about {word}. I will quote a verse about {word}.",
                r.choice(self.about[word]))

    def plain(self, mode: str) -> list[dict]:
        messages = [{"role": "system", "content": "You are a helpful assistant."}] if self.rng.random() < 0.3 else []
        for _ in range(self.rng.choice((1, 1, 2, 3))):
            user, reasoning, content = self.task()
            messages += [{"role": "user", "content": user},
                         {"role": "assistant", "content": content,
                          **({"reasoning_content": reasoning} if mode == THINKING else {})}]
        return messages

    def tool_round_trip(self, mode: str) -> list[dict]:
        r = self.rng
        if r.random() < 0.5:
            word, limit = r.choice(sorted(self.about)), r.randint(1, 3)
            user = f"Find {NUMBERS[limit]} about {word}."
            call, result = ("search_verses", {"query": word, "limit": limit}), self.search_verses(word, limit)
            think = (f"The user wants verses about {word}. I will call search_verses.",
                     "The tool found verses. I will quote the first one.")
            answer = f'Here is a verse about {word}: "{result[0]}"'
        else:
            text = r.choice(self.sents)
            user = f"How many words are in: {text}"
            call, result = ("count_words", {"text": text}), self.count_words(text)
            think = ("The user wants the number of words. I will call count_words.",
                     f"The tool says {result}. I will give the answer.")
            answer = f"There are {result} words."
        call_id = f"call_{r.randrange(16 ** 8):08x}"
        first = {"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": call[0], "arguments": json.dumps(call[1])}}]}
        last = {"role": "assistant", "content": answer}
        if mode == THINKING:
            first["reasoning_content"], last["reasoning_content"] = think
        return [{"role": "user", "content": user}, first,
                {"role": "tool", "tool_call_id": call_id, "content": json.dumps(result)}, last]

    def next(self, tools: bool) -> tuple[list[dict], list[dict] | None, str]:
        """A conversation in thinking or chat mode; with `tools` the tool set is offered and
        mostly used (a round trip), else a plain one."""
        mode = self.rng.choice((THINKING, CHAT))
        if not tools:
            return self.plain(mode), None, mode
        return (self.tool_round_trip(mode) if self.rng.random() < 0.85 else self.plain(mode)), TOOLS, mode


def render(messages: list[dict], tools: list[dict] | None, mode: str) -> str:
    return encode_messages(messages, mode, tools=tools)


def reply_labels(ids: list[int], assistant_id: int, eos_id: int, ignore: int = -100) -> list[int]:
    """Labels for next-token loss on the assistant's replies only: from the token after the
    prompt's `<｜Assistant｜>` + `<think>`/`</think>` through the reply's EOS; else `ignore`."""
    labels, inside = [ignore] * len(ids), False
    for i, t in enumerate(ids):
        if inside:
            labels[i] = t
            inside = t != eos_id
        elif t == assistant_id:
            inside = None                        # the mode token after it belongs to the prompt
        elif inside is None:
            inside = True
    return labels
