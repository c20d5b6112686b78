"""The checkpoint's tokenizer: `tokenizer.json` through the `tokenizers` library, plus
end-of-sequence ids, padding and the chat template of the checkpoint folder."""

from __future__ import annotations

import json
import os
import re
import secrets
import threading

from tokenizers import Tokenizer as _HfTokenizer

_SIMPLE_TEMPLATE = re.compile(
    r"\{%-?\s*for (\w+) in messages\s*-?%\}(.*?)\{\{\s*\1\.role\s*\}\}(.*?)\{\{\s*\1\.content\s*\}\}(.*?)"
    r"\{%-?\s*endfor\s*-?%\}(.*)",
    re.S,
)
"""The one template form the built-in renderer understands:
`{% for m in messages %}A{{ m.role }}B{{ m.content }}C{% endfor %}D` with literal A, B, C, D."""


LONG_TEXT_CHARS = 4096
"""Texts at least this long are encoded with the GIL released (the library's batch call), so a long prompt
does not stall the caller's other threads; shorter ones take the plain call, which is cheaper."""
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_symbols() -> list[str]:
    """The printable character standing for each byte 0..255 in byte-level BPE vocabularies.

    Printable Latin-1 bytes stand for themselves; the others are shifted to
    code points 256, 257, ... in byte order.
    """
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)}
    symbols, shifted = [], 0
    for b in range(256):
        if b in printable:
            symbols.append(chr(b))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


class TokenizerError(RuntimeError):
    """A checkpoint folder whose tokenizer files are missing or unusable."""


class TextTooLong(ValueError):
    """A text with more characters (`chars`) than the caller allows (`limit`); nothing was encoded."""

    def __init__(self, chars: int, limit: int) -> None:
        super().__init__(f"the text has {chars} characters; at most {limit} are allowed")
        self.chars, self.limit = chars, limit


class Tokenizer:
    """Text to token ids and back, with the checkpoint's special ids and chat template."""

    def __init__(
        self,
        tokenizer: _HfTokenizer,
        eos_token_ids: tuple[int, ...],
        pad_token_id: int | None,
        chat_template: str | None,
    ) -> None:
        self._tok = tokenizer
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template
        added = tokenizer.get_added_tokens_decoder()
        self.special_token_ids = frozenset(i for i, t in added.items() if t.special)
        """Ids of the added tokens marked special (role markers, end of text, ...)."""
        specials = sorted({added[i].content for i in self.special_token_ids}, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._added = {i: t.content for i, t in added.items()}
        self._plain: _HfTokenizer | None = None  # a copy that reads special-token strings as text
        self._lock = threading.Lock()
        self._bytes: dict[int, bytes] = {}
        self._byte_of: dict[str, int] | None = None
        self._max_token_chars: int | None = None

    @classmethod
    def from_dir(cls, model_dir: str) -> "Tokenizer":
        """The tokenizer of the checkpoint in `model_dir`.

        End-of-sequence ids come from generation_config.json, else config.json,
        else tokenizer_config.json's `eos_token`; padding likewise.
        """
        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(path):
            raise TokenizerError(f"no tokenizer.json in {model_dir}: the checkpoint folder needs its tokenizer files")
        try:
            tok = _HfTokenizer.from_file(path)
        except Exception as e:  # the tokenizers library raises a plain Exception for bad files
            raise TokenizerError(f"{path} is not a valid tokenizer file: {e}") from None
        gen = _read_json(os.path.join(model_dir, "generation_config.json"))
        cfg = _read_json(os.path.join(model_dir, "config.json"))
        text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
        tcfg = _read_json(os.path.join(model_dir, "tokenizer_config.json"))

        def token_id(entry) -> int | None:
            content = entry.get("content") if isinstance(entry, dict) else entry
            return tok.token_to_id(content) if isinstance(content, str) else None

        eos = _first_ids(gen.get("eos_token_id"), cfg.get("eos_token_id"), text_cfg.get("eos_token_id"))
        if not eos and token_id(tcfg.get("eos_token")) is not None:
            eos = (token_id(tcfg.get("eos_token")),)
        pad = next(
            (p for p in (gen.get("pad_token_id"), cfg.get("pad_token_id"), text_cfg.get("pad_token_id"),
                         token_id(tcfg.get("pad_token"))) if isinstance(p, int)),
            None,
        )
        return cls(tok, eos, pad, tcfg.get("chat_template"))

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (special tokens included)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        """The token ids of `text`: special-token strings inside it become their ids, or with
        `special_tokens=False` are read as plain text."""
        tok = self._tok if special_tokens or self._special_re is None else self._plain_tokenizer()
        if len(text) >= LONG_TEXT_CHARS:
            return tok.encode_batch([text], add_special_tokens=False)[0].ids
        return tok.encode(text, add_special_tokens=False).ids

    def _plain_tokenizer(self) -> _HfTokenizer:
        with self._lock:
            if self._plain is None:
                plain = _HfTokenizer.from_str(self._tok.to_str())
                plain.encode_special_tokens = True
                self._plain = plain
            return self._plain

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    special_tokens_in_content: bool = False, max_chars: int | None = None) -> list[int]:
        """The token ids of chat `messages` rendered with the chat template. Special tokens come from the
        template only: special-token strings inside a message's content are read as plain text (so a user
        cannot forge a role boundary), unless `special_tokens_in_content`.

        Where no content holds such a string this is `encode(apply_chat_template(messages))`. Otherwise each
        such string is swapped for a placeholder while rendering; the text between the template's special
        tokens is then encoded as plain text with the strings put back (the library likewise encodes the
        text between special tokens piece by piece). A rendered text of more than `max_chars` characters
        raises `TextTooLong` before it is encoded."""
        pattern = self._special_re
        if special_tokens_in_content or pattern is None or not any(pattern.search(m["content"]) for m in messages):
            text = self.apply_chat_template(messages, add_generation_prompt)
            _check_length(text, max_chars)
            return self.encode(text)
        nonce = secrets.token_hex(8)
        held: list[str] = []

        def hold(m: re.Match) -> str:
            held.append(m.group(0))
            return f"\ue000{nonce}:{len(held) - 1}\ue001"

        masked = [{**m, "content": pattern.sub(hold, m["content"])} for m in messages]
        text = self.apply_chat_template(masked, add_generation_prompt)
        _check_length(text, max_chars)  # each placeholder differs in length from its string by a few characters
        placeholder = re.compile(f"\ue000{nonce}:(\\d+)\ue001")
        ids: list[int] = []
        pos = 0
        for m in [*pattern.finditer(text), None]:
            piece = text[pos:m.start() if m else len(text)]
            if piece:
                ids += self.encode(placeholder.sub(lambda p: held[int(p.group(1))], piece), special_tokens=False)
            if m is not None:
                ids.append(self._tok.token_to_id(m.group(0)))
                pos = m.end()
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of token ids `ids`, without special tokens if asked."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of token string `token`, or None."""
        return self._tok.token_to_id(token)

    def knows(self, token_id: int) -> bool:
        """Whether `token_id` is a token of this tokenizer (a model's vocabulary may be padded past it)."""
        return self._tok.id_to_token(token_id) is not None

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes token `token_id` stands for: part of a character for some tokens (Chinese text in
        byte-level vocabularies), which `decode` would show as U+FFFD."""
        found = self._bytes.get(token_id)
        if found is not None:
            return found
        if self._byte_of is None:
            byte_level = "ByteLevel" in _decoder_kinds(self._tok)
            self._byte_of = {c: b for b, c in enumerate(byte_symbols())} if byte_level else {}
        piece = self._tok.id_to_token(token_id)
        if token_id in self._added:
            found = self._added[token_id].encode()
        elif piece is not None and self._byte_of and all(c in self._byte_of for c in piece):
            found = bytes(self._byte_of[c] for c in piece)
        elif piece is not None and _BYTE_FALLBACK.fullmatch(piece):
            found = bytes([int(piece[3:5], 16)])
        else:
            found = self.decode([token_id]).encode()
        self._bytes[token_id] = found
        return found

    @property
    def max_token_chars(self) -> int | None:
        """The most characters of text one token can stand for (its vocabulary string is at least as long as
        its text), or None where a normalizer may shrink text before it is split, so no such bound holds."""
        if self._max_token_chars is None and self._tok.normalizer is None:
            self._max_token_chars = max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)
        return self._max_token_chars

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of chat `messages` (dicts with `role` and `content`), rendered with the
        checkpoint's chat template: by jinja2 when installed, else by a built-in renderer of the
        simple one-loop template form."""
        if not self.chat_template:
            raise TokenizerError("this checkpoint's tokenizer_config.json has no chat_template")
        try:
            import jinja2.sandbox
        except ImportError:
            return render_simple_template(self.chat_template, messages)
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt
        )


def render_simple_template(template: str, messages: list[dict]) -> str:
    """`template` rendered without jinja2; only the form
    `{% for m in messages %}A{{ m.role }}B{{ m.content }}C{% endfor %}D` (literal A..D) is understood."""
    m = _SIMPLE_TEMPLATE.fullmatch(template.strip())
    if m is None or any("{" in part for part in m.groups()[1:]):
        raise TokenizerError("this chat template needs jinja2 (pip install jinja2); the built-in renderer only "
                             "handles `{% for m in messages %}..{{ m.role }}..{{ m.content }}..{% endfor %}..`")
    _, before, between, after, tail = m.groups()
    return "".join(f"{before}{msg['role']}{between}{msg['content']}{after}" for msg in messages) + tail


def _check_length(text: str, max_chars: int | None) -> None:
    if max_chars is not None and len(text) > max_chars:
        raise TextTooLong(len(text), max_chars)


def _decoder_kinds(tok: _HfTokenizer) -> set[str]:
    """The types of the tokenizer's decoder and of the decoders in it (a Sequence)."""
    if tok.decoder is None:
        return set()
    state = json.loads(tok.decoder.__getstate__())
    return {state.get("type"), *(d.get("type") for d in state.get("decoders") or [])}


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from None
    return data if isinstance(data, dict) else {}


def _first_ids(*candidates) -> tuple[int, ...]:
    """The first candidate given as an int or a list of ints, as a tuple."""
    for c in candidates:
        if isinstance(c, int):
            return (c,)
        if isinstance(c, list) and c and all(isinstance(x, int) for x in c):
            return tuple(c)
    return ()
