"""The OpenAI response pieces built from engine outputs: logprobs objects, usage, server-sent events."""

from __future__ import annotations

import codecs
import json
import math

from ..tokenizer import Tokenizer

DONE = b"data: [DONE]\n\n"
"""The event that ends every stream."""
NEG_INF_LOGPROB = -9999.0
"""What a logprob of -inf is reported as (JSON has no infinity)."""


def sse(obj) -> bytes:
    """One server-sent event carrying `obj` as JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """The usage object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _finite(x: float) -> float:
    return x if math.isfinite(x) else NEG_INF_LOGPROB


class TokenTexts:
    """Each token's name in logprobs and its bytes. A token that is part of a character (common in Chinese
    text) has no text of its own: it is named by its bytes, `bytes:\\xe4\\xb8`, as the OpenAI API does; an id
    past the tokenizer's vocabulary (the model's is padded) is named `token_id:<id>`. So distinct tokens never
    share a name."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._known: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        found = self._known.get(token_id)
        if found is None and not self.tokenizer.knows(token_id):
            found = self._known[token_id] = (f"token_id:{token_id}", b"")
        if found is None:
            raw = self.tokenizer.token_bytes(token_id)
            try:
                name = raw.decode("utf-8")
            except UnicodeDecodeError:
                name = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            found = self._known[token_id] = (name, raw)
        return found


class Logprobs:
    """One request's logprobs objects, a run of tokens at a time (streams send several), with the text
    offsets (completions) carried from one run to the next."""

    def __init__(self, texts: TokenTexts, chat: bool, skipped: frozenset[int] = frozenset()) -> None:
        self.texts, self.chat, self.skipped = texts, chat, skipped
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._offset = 0

    def build(self, token_ids: list[int], logprobs: list[float], tops: list[list[tuple[int, float]]]) -> dict:
        """The logprobs object of `token_ids`, with each one's logprob and its alternatives (id, logprob)."""
        tops = list(tops) + [[]] * (len(token_ids) - len(tops))
        if self.chat:
            def entry(t: int, lp: float) -> dict:
                name, raw = self.texts(t)
                return {"token": name, "logprob": _finite(lp), "bytes": list(raw)}

            return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
                                for t, lp, top in zip(token_ids, logprobs, tops)]}
        tokens, offsets, top_maps = [], [], []
        for t, lp, top in zip(token_ids, logprobs, tops):
            name, raw = self.texts(t)
            tokens.append(name)
            offsets.append(self._offset)
            if t not in self.skipped:  # the offset counts characters of the returned text
                self._offset += len(self._utf8.decode(raw))
            alternatives = {self.texts(i)[0]: _finite(v) for i, v in top}
            alternatives.setdefault(name, _finite(lp))
            top_maps.append(alternatives)
        return {"tokens": tokens, "token_logprobs": [_finite(x) for x in logprobs[:len(tokens)]],
                "top_logprobs": top_maps, "text_offset": offsets}
