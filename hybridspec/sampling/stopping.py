"""When a request stops, and how much of a round's tokens it keeps.

A request ends at the first of: a stop token (`stop_token_ids`, or the
model's EOS ids unless `ignore_eos`), a stop string (`stop`) appearing in the
decoded output text, or `max_new_tokens`. The token that ends it is kept
(a stop string may end inside it, or span several tokens: the output text is
cut just before the string). A speculative round that emits past the stop is
cut back there, exactly like plain decoding, which would have stopped at the
same token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

Decode = Callable[[list[int]], str]  # token ids -> text


@dataclass(frozen=True)
class Cut:
    """What emitting a list of tokens does to a request."""

    kept: int  # leading tokens kept
    finish_reason: Literal["stop", "length"] | None = None  # None: the request goes on
    stop_reason: int | str | None = None  # the stop token id or string; None: EOS, length or not finished

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class StopRule:
    """The stop conditions of one request."""

    max_new_tokens: int
    stop_token_ids: frozenset[int]  # stop tokens reported as the stop reason
    eos_token_ids: frozenset[int]  # stop tokens reported as EOS (stop reason None)
    stop_strings: tuple[str, ...] = ()
    decode: Decode | None = None  # required when stop_strings is not empty

    def cut(self, output: list[int], tokens: list[int]) -> Cut:
        """The Cut of appending `tokens` to the generated tokens `output`."""
        room = self.max_new_tokens - len(output)
        for i, t in enumerate(tokens[:room]):
            if t in self.eos_token_ids:
                return Cut(i + 1, "stop")
            if t in self.stop_token_ids:
                return Cut(i + 1, "stop", t)
            found = self.stop_string(output + tokens[:i + 1])
            if found is not None:
                return Cut(i + 1, "stop", found)
        kept = min(len(tokens), room)
        return Cut(kept, "length" if len(output) + kept >= self.max_new_tokens else None)

    def stop_string(self, output: list[int]) -> str | None:
        """The stop string occurring earliest in the decoded output, or None."""
        if not self.stop_strings:
            return None
        text = self.decode(output)
        hits = [(text.find(s), s) for s in self.stop_strings if s in text]
        return min(hits)[1] if hits else None


def cut_text(text: str, stop_reason: int | str | None) -> str:
    """The output text a user sees: cut just before a stop string."""
    return text[:text.find(stop_reason)] if isinstance(stop_reason, str) else text
