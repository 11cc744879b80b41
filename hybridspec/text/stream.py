"""`TextStream`: one sequence's output text, handed out in deltas that
concatenate to the finished text (cut before its stop string), the text
`hs.LLM` returns for the same tokens. The server streams each request's
text through one (`hybridspec.serve`), `hybridspec generate` the text it
prints as rounds commit.

Each step decodes only the tokens since the last stable point (a window of
the last round or two, as vLLM's incremental detokenizer does), not the
whole output: the text grows once the window's decoding no longer ends in
U+FFFD (an incomplete UTF-8 character or merge the next token may
complete). Until the sequence ends, the last (longest stop string - 1)
characters are held back too (a stop string may still complete there and
cut them), and nothing from a stop string on is handed out (a caller that
learns of the end only afterwards, as `Engine.generate`'s stream callback,
never shows it). At the end the whole output is decoded once, exactly as
offline.
"""
from __future__ import annotations

from hybridspec.sampling.stopping import Decode, cut_text


class TextStream:
    def __init__(self, decode: Decode, stop: tuple[str, ...] = ()):
        self.decode, self.stop = decode, stop
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # the stable text so far
        self.prefix_offset = self.read_offset = 0  # token_ids[prefix_offset:read_offset] decode to text's tail
        self.sent = 0  # characters handed out

    def push(self, token_ids: list[int], finished: bool = False, stop_reason: int | str | None = None) -> str:
        """The new text after `token_ids` (the whole rest when `finished`)."""
        self.token_ids.extend(token_ids)
        if finished:
            return self._take(cut_text(self.decode(self.token_ids), stop_reason), None)
        known = self.decode(self.token_ids[self.prefix_offset:self.read_offset])
        window = self.decode(self.token_ids[self.prefix_offset:])
        if len(window) > len(known) and not window.endswith("\ufffd"):
            self.text += window[len(known):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        stops = [self.text.find(s) for s in self.stop if s in self.text]
        return self._take(self.text, min(stops) if stops else len(self.text) - self.holdback)

    def _take(self, text: str, end: int | None) -> str:
        end = len(text) if end is None else end
        if end <= self.sent:
            return ""
        delta, self.sent = text[self.sent:end], end
        return delta
