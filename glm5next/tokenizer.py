"""The checkpoint's tokenizer: `tokenizer.json` through the `tokenizers` library, plus
end-of-sequence ids, padding and the chat template of the checkpoint folder."""

from __future__ import annotations

import json
import os
import re

from tokenizers import Tokenizer as _HfTokenizer

_SIMPLE_TEMPLATE = re.compile(
    r"\{%-?\s*for (\w+) in messages\s*-?%\}(.*?)\{\{\s*\1\.role\s*\}\}(.*?)\{\{\s*\1\.content\s*\}\}(.*?)"
    r"\{%-?\s*endfor\s*-?%\}(.*)",
    re.S,
)
"""The one template form the built-in renderer understands:
`{% for m in messages %}A{{ m.role }}B{{ m.content }}C{% endfor %}D` with literal A, B, C, D."""


class TokenizerError(RuntimeError):
    """A checkpoint folder whose tokenizer files are missing or unusable."""


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

    def encode(self, text: str) -> list[int]:
        """The token ids of `text` (special-token strings inside it become their ids)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of token ids `ids`, without special tokens if asked."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of token string `token`, or None."""
        return self._tok.token_to_id(token)

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
