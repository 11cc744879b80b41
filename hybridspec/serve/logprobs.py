"""The log-probs of one choice in step with its text, and their OpenAI bodies.

A choice's log-probs cover the tokens of the text it returns, as OpenAI's
do: none for the tokens of a stop string the text was cut before (the token
that holds the last returned characters stays). While streaming, a token's
entry goes out with the text that holds it: not before (its text may be a
stop string's start, or half a character), not after.

Scoring (`echo`, vLLM's `prompt_logprobs`): an echoed prompt's tokens come
first in a choice's log-probs, the first one's `null` (nothing precedes it),
`text_offset` counting from the prompt's start on into the generated text, as
OpenAI's legacy completions and vLLM give them.
"""
from __future__ import annotations

from hybridspec.sampling.logprobs import TokenLogprob
from hybridspec.sampling.stopping import Decode

NEG_INF_JSON = -9999.0  # JSON has no -inf: a token the filters removed reads as OpenAI's most negative logprob


class LogprobStream:
    """One choice's token entries, handed out as the text that holds them is (`push`)."""

    def __init__(self, decode: Decode):
        self.decode = decode
        self.token_ids: list[int] = []
        self.entries: list[TokenLogprob] = []
        self.sent = 0  # entries handed out

    def push(self, token_ids: list[int], entries: list[TokenLogprob] | None, text: str, finished: bool,
             stop_reason: int | str | None = None) -> list[TokenLogprob]:
        """The new entries after `token_ids`, given `text`: all the text handed
        out so far (at the end: the choice's whole text)."""
        self.token_ids.extend(token_ids)
        self.entries.extend(entries or [])
        end = self._returned(text) if finished and isinstance(stop_reason, str) \
            else len(self.entries) if finished else self._held(text)
        delta, self.sent = self.entries[self.sent:end], max(self.sent, end)
        return delta

    def _held(self, text: str) -> int:
        """How many tokens `text` holds whole (their decoded prefix is text's start)."""
        end = self.sent
        while end < len(self.token_ids) and text.startswith(self.decode(self.token_ids[:end + 1])):
            end += 1
        return end

    def _returned(self, text: str) -> int:
        """The fewest tokens whose text covers `text` (the rest are the stop string's)."""
        end = self.sent
        while end < len(self.token_ids) and not self.decode(self.token_ids[:end]).startswith(text):
            end += 1
        return end


def finite(value: float) -> float:
    return value if value > -float("inf") else NEG_INF_JSON


class CompletionLogprobs:
    """/v1/completions' `logprobs` of one choice, chunk after chunk: `text_offset`
    goes on across chunks, and `top_logprobs` holds the sampled token too (as
    OpenAI and vLLM: up to logprobs + 1 entries; logprobs=0: just it)."""

    def __init__(self, decode: Decode):
        self.decode = decode
        self.offset = 0  # characters of the tokens handed out before

    def body(self, entries: list[TokenLogprob]) -> dict:
        tokens = [self.decode([e.token_id]) for e in entries]
        return {"tokens": tokens, "token_logprobs": [finite(e.logprob) for e in entries],
                "top_logprobs": [self._top(e) for e in entries], "text_offset": self._offsets(tokens)}

    def prompt(self, token_ids: list[int], entries: list[TokenLogprob | None], k: int) -> dict:
        """The echoed prompt's part (before any generated token's): each prompt token, its
        log-prob and its k most likely tokens (`null` for the first token)."""
        tokens = [self.decode([t]) for t in token_ids]
        return {"tokens": tokens, "token_logprobs": [None if e is None else finite(e.logprob) for e in entries],
                "top_logprobs": [None if e is None else self._top(e, k) for e in entries],
                "text_offset": self._offsets(tokens)}

    def _offsets(self, tokens: list[str]) -> list[int]:
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        return offsets

    def _top(self, entry: TokenLogprob, k: int | None = None) -> dict:
        """{token text: log p} of the entry's token and its k (None: all recorded) most likely."""
        top = {self.decode([entry.token_id]): finite(entry.logprob)}
        for token_id, logprob in entry.top[:k]:
            top.setdefault(self.decode([token_id]), finite(logprob))
        return top


def joined(first: dict | None, second: dict | None) -> dict | None:
    """Two parts of one choice's completions `logprobs`, one after the other."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


def prompt_logprobs_body(entries: list[TokenLogprob | None], k: int, decode: Decode) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of a choice: None for the first prompt token, then per token
    {token id: {logprob, rank, decoded_token}} of the token and the k most likely (ranks 1..k)."""
    def entry(token_id: int, logprob: float, rank: int) -> dict:
        return {"logprob": finite(logprob), "rank": rank, "decoded_token": decode([token_id])}
    out: list[dict | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        ranked = {e.token_id: entry(e.token_id, e.logprob, e.rank)}
        for rank, (token_id, logprob) in enumerate(e.top[:k], start=1):
            ranked.setdefault(token_id, entry(token_id, logprob, rank))
        out.append(ranked)
    return out


def chat_logprobs(entries: list[TokenLogprob], decode: Decode) -> dict:
    """/v1/chat/completions' `logprobs` (`top_logprobs`: the k asked for, as OpenAI)."""
    def entry(token_id: int, logprob: float) -> dict:
        text = decode([token_id])
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}
    return {"content": [{**entry(e.token_id, e.logprob), "top_logprobs": [entry(t, v) for t, v in e.top]}
                        for e in entries]}
