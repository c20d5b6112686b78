"""The byte-level tokenizer files of a tiny checkpoint: one token per byte plus chat special tokens."""

from __future__ import annotations

import json
import os

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from ..tokenizer import byte_symbols

SPECIAL_TOKENS = ("<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|pad|>")
"""Special tokens, with ids 256, 257, ... in this order."""
EOS_TOKEN = "<|endoftext|>"
"""End of sequence (id 256)."""
PAD_TOKEN = "<|pad|>"
"""Padding (id 260)."""
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
"""Jinja chat template: each message as `<|role|>content`, then the assistant prompt."""


def byte_tokenizer() -> Tokenizer:
    """A byte-level BPE tokenizer without merges: byte b is token b, specials follow at 256."""
    vocab = {s: b for b, s in enumerate(byte_symbols())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != 256 + i:
            raise RuntimeError(f"special token {t} got id {tok.token_to_id(t)}, expected {256 + i}")
    return tok


def write_tokenizer(out_dir: str, eos_token_id: int, pad_token_id: int | None) -> None:
    """`tokenizer.json` and `tokenizer_config.json` in `out_dir`; the ids must be those of the specials."""
    tok = byte_tokenizer()
    pad_ok = pad_token_id is None or tok.token_to_id(PAD_TOKEN) == pad_token_id
    if tok.token_to_id(EOS_TOKEN) != eos_token_id or not pad_ok:
        raise ValueError(f"the tiny tokenizer has eos=256 and pad=260, not eos={eos_token_id} pad={pad_token_id}")
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    added = {
        str(256 + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                       "single_word": False, "special": True}
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
