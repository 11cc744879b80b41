"""`TextStream`: one sequence's output text, handed out in deltas that always
concatenate to the finished text (cut before its stop string).

Until the sequence ends, the last (longest stop string - 1) characters are
held back (a stop string may still complete there and cut them), and so is
a trailing U+FFFD (an incomplete UTF-8 character that the next token may
complete)."""
from __future__ import annotations

from ..stopping import Decode, cut_text


class TextStream:
    def __init__(self, decode: Decode, stop: tuple[str, ...]):
        self.decode = decode
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.sent = 0  # characters handed out

    def push(self, token_ids: list[int], finished: bool, stop_reason: int | str | None) -> str:
        """The new text after `token_ids` (the whole rest when `finished`)."""
        self.token_ids.extend(token_ids)
        text = self.decode(self.token_ids)
        if finished:
            text, end = cut_text(text, stop_reason), None
        else:
            end = len(text) - self.holdback
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        end = len(text) if end is None else end
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent:end], end
        return delta
