"""Token ids of checked requests, within the context. This is the work whose cost grows with the input
(rendering the chat template, tokenizing), so the server runs it in worker threads, never on the event
loop, and refuses a text by its length in characters before tokenizing it."""

from __future__ import annotations

from ..tokenizer import TextTooLong, Tokenizer
from .api import ApiError, GenerateRequest


class PromptBuilder:
    """The prompt token ids of requests to an engine with `tokenizer` and a context of `max_model_len`."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer, self.max_model_len, self.vocab_size = tokenizer, max_model_len, vocab_size
        per_token = tokenizer.max_token_chars
        self.max_chars = None if per_token is None else per_token * (max_model_len - 1)
        """The most characters a prompt that leaves room for one generated token can have (None: no bound
        is known for this tokenizer, so every text is tokenized)."""

    def token_ids(self, req: GenerateRequest) -> list[int]:
        """The request's prompt token ids; raises ApiError (400) for a prompt that does not fit the context
        with the `max_tokens` asked for."""
        where = "messages" if req.chat else "prompt"
        if req.chat:
            self._check_chars(sum(len(m["content"]) for m in req.messages), "the messages' content", where)
            try:
                ids = self.tokenizer.encode_chat(req.messages, special_tokens_in_content=req.special_tokens_in_content,
                                                 max_chars=self.max_chars)
            except TextTooLong as e:
                raise self._chars_error(e.chars, "the rendered chat", where) from None
            except Exception as e:  # template errors (jinja2 or the built-in renderer)
                raise ApiError(400, f"the messages could not be rendered with the chat template: {e}",
                               param="messages") from None
        elif isinstance(req.prompt, str):
            self._check_chars(len(req.prompt), "the prompt", where)
            ids = self.tokenizer.encode(req.prompt)
        else:
            ids = req.prompt
            if len(ids) >= self.max_model_len:
                self._too_long(len(ids), where)
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ApiError(400, f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                               param="prompt")
        if not ids:
            raise ApiError(400, f"the {where} is empty", param=where)
        if len(ids) >= self.max_model_len:
            self._too_long(len(ids), where)
        room = self.max_model_len - len(ids)
        if req.max_tokens is not None and req.max_tokens > room:
            field = "max_tokens" if not req.chat else "max_completion_tokens"
            raise ApiError(400, f"this model's context holds {self.max_model_len} tokens (max_model_len); the "
                                f"{where} has {len(ids)} and {req.max_tokens} more were asked for ({field}): ask for "
                                f"at most {room}, or leave {field} out to use the rest of the context",
                           param="max_tokens", code="context_length_exceeded")
        return ids

    def _check_chars(self, chars: int, what: str, param: str) -> None:
        if self.max_chars is not None and chars > self.max_chars:
            raise self._chars_error(chars, what, param)

    def _chars_error(self, chars: int, what: str, param: str) -> ApiError:
        return ApiError(400, f"{what} has {chars} characters, more than the {self.max_chars} that can fit in this "
                             f"model's context of {self.max_model_len} tokens (max_model_len)", param=param,
                        code="context_length_exceeded")

    def _too_long(self, tokens: int, where: str) -> None:
        raise ApiError(400, f"the {where} has {tokens} tokens; this model's context holds {self.max_model_len} "
                            f"(max_model_len), leaving no room to generate", param=where,
                       code="context_length_exceeded")
