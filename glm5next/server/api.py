"""The OpenAI request bodies, checked: JSON bytes in, a `GenerateRequest` out, or an `ApiError` naming the
field at fault. Independent of the web framework (bytes and dicts only), and bounded: no field makes the
engine do work that grows without limit."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ..runtime.sampler import MAX_LOGPROBS, SamplingParams

MAX_STOP_STRINGS = 4
"""The most stop strings a request may give, as the OpenAI API allows."""
MAX_STOP_CHARS = 256
"""The longest stop string, in characters (a stream holds back that many characters while one may complete)."""
MAX_STOP_TOKEN_IDS = 256
"""The most stop token ids a request may give (each generated token is checked against them)."""
ERROR_TYPES = {404: "not_found_error", 408: "timeout_error", 500: "server_error",
               503: "server_error"}
"""OpenAI error types by HTTP status; other 4xx are `invalid_request_error`."""
_KINDS = {"int": "an integer", "float": "a number", "bool": "a boolean", "str": "a string",
          "list": "an array", "dict": "an object"}
_ROLES = ("system", "developer", "user", "assistant", "tool")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A JSON escape of a UTF-16 surrogate (only then is the parsed body searched for unpaired ones)."""


class ApiError(Exception):
    """A request answered with `status` and an OpenAI error body naming the field at fault (`param`)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        """The OpenAI error object."""
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


@dataclass
class GenerateRequest:
    """A checked completion or chat request, before its prompt is tokenized."""

    chat: bool
    prompt: str | list[int] | None
    """Completions: the prompt text or token ids."""
    messages: list[dict] | None
    """Chat: the messages, each `{"role", "content"}` with text content."""
    params: SamplingParams
    """Sampling; `max_tokens` is filled in from the context when the request gives none."""
    max_tokens: int | None
    """As asked (None: the rest of the context)."""
    logprobs: int | None
    """Alternatives to report per token (None: no logprobs)."""
    stream: bool
    include_usage: bool
    special_tokens_in_content: bool
    """Chat: read special-token strings in message content as the special tokens (default: as text)."""


def parse_json(body: bytes) -> dict:
    """The request's JSON object."""
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(body):  # JSON escapes can spell lone surrogates, which no tokenizer accepts
        try:
            json.dumps(data, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise ApiError(400, "the request body holds an unpaired UTF-16 surrogate escape") from None
    return data


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


class Fields:
    """The request object's fields with typed, checked access."""

    def __init__(self, data: dict) -> None:
        self.data = data

    def get(self, key: str, kind: str, default=None, required: bool = False, upto: int | None = None):
        """The field `key` of type `kind` (`default` when absent or null); ints may be bounded to [0, upto]."""
        value = self.data.get(key)
        if value is None:
            if required:
                raise ApiError(400, f"'{key}' is required", param=key)
            return default
        ok = {"int": isinstance(value, int) and not isinstance(value, bool),
              "float": isinstance(value, (int, float)) and not isinstance(value, bool),
              "bool": isinstance(value, bool), "str": isinstance(value, str),
              "list": isinstance(value, list), "dict": isinstance(value, dict)}[kind]
        if not ok:
            raise ApiError(400, f"'{key}' must be {_KINDS[kind]}, not {type(value).__name__}", param=key)
        if upto is not None and not 0 <= value <= upto:
            raise ApiError(400, f"'{key}' must be in [0, {upto}], not {value}", param=key)
        if kind == "float":
            try:
                return float(value)
            except OverflowError:
                raise ApiError(400, f"'{key}' is out of range", param=key) from None
        return value

    def unsupported(self, **neutral) -> None:
        """Refuse fields this server does not implement unless they hold their neutral value."""
        for key, ok in neutral.items():
            if self.data.get(key) not in (None, ok):
                raise ApiError(400, f"'{key}' is not supported by this server (only {ok!r})", param=key)


def check_model(f: Fields, model_name: str) -> None:
    """Refuse a request for a model this server does not serve."""
    model = f.get("model", "str")
    if model is not None and model != model_name:
        raise ApiError(404, f"The model `{model}` does not exist (this server serves `{model_name}`)",
                       param="model", code="model_not_found")


def parse_completion(data: dict, model_name: str, vocab_size: int) -> GenerateRequest:
    """A `/v1/completions` request."""
    f = Fields(data)
    check_model(f, model_name)
    prompt = _prompt(data.get("prompt"))
    f.unsupported(echo=False, suffix="", best_of=1)
    top = f.get("logprobs", "int", upto=MAX_LOGPROBS)
    max_tokens = f.get("max_tokens", "int")
    return _request(f, False, prompt, None, max_tokens, top, vocab_size)


def parse_chat(data: dict, model_name: str, vocab_size: int) -> GenerateRequest:
    """A `/v1/chat/completions` request."""
    f = Fields(data)
    check_model(f, model_name)
    messages = _messages(f.get("messages", "list", required=True))
    f.unsupported(tools=[], functions=[], response_format={"type": "text"})
    top = f.get("top_logprobs", "int", 0, upto=MAX_LOGPROBS)
    if not f.get("logprobs", "bool", False):
        if top:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        top = None
    max_tokens = f.get("max_completion_tokens", "int")
    max_tokens = f.get("max_tokens", "int") if max_tokens is None else max_tokens
    return _request(f, True, None, messages, max_tokens, top, vocab_size)


def _request(f: Fields, chat: bool, prompt, messages, max_tokens, top, vocab_size) -> GenerateRequest:
    stream = f.get("stream", "bool", False)
    options = f.get("stream_options", "dict")
    if options is not None and not stream:
        raise ApiError(400, "'stream_options' needs 'stream': true", param="stream_options")
    return GenerateRequest(chat, prompt, messages, _params(f, max_tokens, top, vocab_size), max_tokens, top, stream,
                           bool(options and options.get("include_usage")),
                           f.get("special_tokens_in_content", "bool", False))


def _prompt(prompt):
    def ids(x) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(prompt, str) or ids(prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) == 1 and (isinstance(prompt[0], str) or ids(prompt[0])):
        return prompt[0]
    if prompt is None:
        raise ApiError(400, "'prompt' is required", param="prompt")
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, "batched prompts are not supported: send one prompt per request", param="prompt")
    raise ApiError(400, "'prompt' must be a string, a list of one string, or a list of token ids", param="prompt")


def _messages(messages: list) -> list[dict]:
    if not messages:
        raise ApiError(400, "'messages' must not be empty", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise ApiError(400, f"messages[{i}] must be an object with a role in {list(_ROLES)}", param="messages")
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p["text"] for p in content)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")
        out.append({"role": m["role"], "content": content})
    return out


def _stop(f: Fields) -> list[str] | None:
    stop = f.data.get("stop")
    if stop is None or stop == []:
        return None
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "'stop' must be a non-empty string or a list of them", param="stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise ApiError(400, f"'stop' holds {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed", param="stop")
    longest = max(map(len, stop))
    if longest > MAX_STOP_CHARS:
        raise ApiError(400, f"a stop string has {longest} characters; at most {MAX_STOP_CHARS} are allowed",
                       param="stop")
    return stop


def _stop_token_ids(f: Fields, vocab_size: int) -> list[int] | None:
    ids = f.get("stop_token_ids", "list")
    if ids is None:
        return None
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise ApiError(400, f"'stop_token_ids' holds {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed",
                       param="stop_token_ids")
    bad = [t for t in ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size)]
    if bad:
        raise ApiError(400, f"'stop_token_ids' must be token ids in [0, {vocab_size}); {bad[0]!r} is not",
                       param="stop_token_ids")
    return ids


def _params(f: Fields, max_tokens: int | None, top: int | None, vocab_size: int) -> SamplingParams:
    f.unsupported(n=1, presence_penalty=0, frequency_penalty=0, repetition_penalty=1)
    if f.get("logit_bias", "dict"):  # an object, and empty: biasing is not implemented
        raise ApiError(400, "'logit_bias' is not supported by this server (only {})", param="logit_bias")
    kw = {k: v for k, v in (
        ("temperature", f.get("temperature", "float")), ("top_p", f.get("top_p", "float")),
        ("min_p", f.get("min_p", "float")), ("top_k", f.get("top_k", "int")),
        ("seed", f.get("seed", "int")), ("ignore_eos", f.get("ignore_eos", "bool")),
        ("skip_special_tokens", f.get("skip_special_tokens", "bool")),
        ("stop", _stop(f)), ("stop_token_ids", _stop_token_ids(f, vocab_size)),
    ) if v is not None}
    if "seed" in kw and not -(2**63) <= kw["seed"] < 2**64:
        raise ApiError(400, "'seed' must fit in 64 bits", param="seed")
    if top is not None:
        kw["logprobs"] = top
    try:
        return SamplingParams(max_tokens=max_tokens if max_tokens is not None else 1, **kw)
    except ValueError as e:
        m = re.match(r"(\w+)=", str(e))
        raise ApiError(400, str(e), param=m.group(1) if m else None) from None
