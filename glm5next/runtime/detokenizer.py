"""Incremental detokenization and stop strings, per request.

Decoding a growing output from scratch every step costs O(length) per token.
Instead each step decodes a short window: the tokens since the last emitted
boundary, with a few earlier tokens for context. Text is emitted only once it
no longer ends in an incomplete character (U+FFFD from a partial UTF-8
sequence), so the concatenation of every emission equals the full decode.
"""

from __future__ import annotations

from ..tokenizer import Tokenizer

CONTEXT_TOKENS = 4
"""Earlier tokens decoded with the window so merges across its left edge come out right."""
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """The text of one request's output tokens, grown a token at a time, with stop strings."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        """Characters held back from streaming while a stop string might still complete."""
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # first token of the decode window
        self._read = 0  # tokens whose text is already in self.text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> bool:
        """Append one token; True when a stop string appeared (the text is then cut before it)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix : self._read])
        now = self._decode(self.ids[self._prefix :])
        if len(now) <= len(before) or now.endswith(REPLACEMENT):
            return False  # an incomplete character: wait for the next token
        start = len(self.text)
        self.text += now[len(before) :]
        self._read = len(self.ids)
        self._prefix = max(self._read - CONTEXT_TOKENS, 0)
        return self._cut_stop(start)

    def flush(self) -> bool:
        """Emit whatever is left (an incomplete character decodes to U+FFFD) at the end of the request."""
        if self._read == len(self.ids):
            return False
        before = self._decode(self.ids[self._prefix : self._read])
        now = self._decode(self.ids[self._prefix :])
        start = len(self.text)
        self.text += now[len(before) :]
        self._read = len(self.ids)
        return self._cut_stop(start)

    def _cut_stop(self, start: int) -> bool:
        """Cut the text before the earliest stop string that ends in the newly added part."""
        if not self.stop:
            return False
        hits = []
        for s in self.stop:
            i = self.text.find(s, max(start - len(s) + 1, 0))
            if i >= 0:
                hits.append(i)
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True

    def visible(self, finished: bool) -> str:
        """The text a stream may show now: all of it once finished, else all but a possible stop prefix."""
        if finished or not self.hold:
            return self.text
        return self.text[: max(len(self.text) - self.hold, 0)]
