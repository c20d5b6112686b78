"""The OpenAI protocol over the async engine: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import json
import logging
import math
import re
import time
import uuid

from ..runtime.sampler import SamplingParams
from .http import HTTPError, HTTPServer, Request, Response, Router, StreamingResponse

logger = logging.getLogger("glm5next.server")

MAX_TOP_LOGPROBS = 20
_ERROR_TYPES = {404: "not_found_error", 408: "timeout_error", 500: "server_error", 503: "server_error"}
_KINDS = {"int": "an integer", "float": "a number", "bool": "a boolean", "str": "a string",
          "list": "an array", "dict": "an object"}
_ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(HTTPError):
    """An HTTP error naming the request field at fault (`param`) and an OpenAI error `code`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(status, message)
        self.param, self.code = param, code


def error_response(e: HTTPError) -> Response:
    """The OpenAI error body of `e`."""
    err = {"message": e.message, "type": _ERROR_TYPES.get(e.status, "invalid_request_error"),
           "param": getattr(e, "param", None), "code": getattr(e, "code", None)}
    resp = Response.json({"error": err}, e.status)
    resp.headers.update(e.headers)
    return resp


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class _Body:
    """The request's JSON object with typed, checked field access."""

    def __init__(self, req: Request) -> None:
        try:
            self.data = json.loads(req.body, parse_constant=self._no_constant)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None
        except RecursionError:
            raise ApiError(400, "the request body is nested too deeply") from None
        if not isinstance(self.data, dict):
            raise ApiError(400, "the request body must be a JSON object")
        try:  # JSON escapes can spell lone surrogates, which no tokenizer accepts
            json.dumps(self.data, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise ApiError(400, "the request body holds an unpaired UTF-16 surrogate escape") from None

    @staticmethod
    def _no_constant(name: str):
        raise ValueError(f"{name} is not a JSON number")

    def get(self, key: str, kind: str, default=None, required: bool = False, upto: int | None = None):
        """The field `key` of type `kind` (None when absent or null); ints may be bounded to [0, upto]."""
        value = self.data.get(key)
        if value is None:
            if required:
                raise ApiError(400, f"'{key}' is required", param=key)
            return default
        if upto is not None and kind == "int" and isinstance(value, int) and not 0 <= value <= upto:
            raise ApiError(400, f"'{key}' must be in [0, {upto}]", param=key)
        ok = {"int": isinstance(value, int) and not isinstance(value, bool),
              "float": isinstance(value, (int, float)) and not isinstance(value, bool),
              "bool": isinstance(value, bool), "str": isinstance(value, str),
              "list": isinstance(value, list), "dict": isinstance(value, dict)}[kind]
        if not ok:
            raise ApiError(400, f"'{key}' must be {_KINDS[kind]}, not {type(value).__name__}", param=key)
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


class OpenAIApp:
    """Routes and handlers of the OpenAI-compatible API over `engine` (an AsyncLLM)."""

    def __init__(self, engine, model_name: str) -> None:
        self.engine, self.model_name = engine, model_name
        self.created = int(time.time())
        self.router = Router()
        self.router.add("GET", "/health", self.health)
        self.router.add("GET", "/v1/models", self.models)
        self.router.add("GET", "/metrics", self.metrics)
        self.router.add("POST", "/v1/completions", self.completions)
        self.router.add("POST", "/v1/chat/completions", self.chat)
        self._token_text: dict[int, str] = {}

    async def __call__(self, req: Request) -> Response | StreamingResponse:
        """Answer `req`; an HTTPError (ApiError included) raised here becomes an error reply."""
        return await self.router.resolve(req.method, req.path)(req)

    # ---------------------------------------------------------------- routes
    async def health(self, req: Request) -> Response:
        if self.engine.errored:
            raise ApiError(503, "the engine stopped")
        return Response(200, b"", "text/plain; charset=utf-8")

    async def metrics(self, req: Request) -> Response:
        """Engine counters in the Prometheus text format, speculative decoding's acceptance included."""
        core = getattr(self.engine, "engine", None)
        stats = dict(getattr(core, "stats", {}) or {})
        lines = []
        for key in ("steps", "graph_steps", "prompt_tokens", "generated_tokens", "preemptions"):
            if key in stats:
                lines += [f"# TYPE glm5next_{key}_total counter", f"glm5next_{key}_total {stats[key]}"]
        lines += ["# TYPE glm5next_requests_running gauge", f"glm5next_requests_running {self.engine.num_unfinished()}"]
        if core is not None and getattr(core, "spec", None):
            m = core.spec_metrics()
            lines += ["# TYPE glm5next_spec_acceptance_rate gauge", f"glm5next_spec_acceptance_rate {m['acceptance_rate']}",
                      "# TYPE glm5next_spec_mean_accepted_length gauge",
                      f"glm5next_spec_mean_accepted_length {m['mean_accepted_length']}",
                      "# TYPE glm5next_spec_acceptance_by_position gauge"]
            lines += [f'glm5next_spec_acceptance_by_position{{position="{i}"}} {a}'
                      for i, a in enumerate(m["acceptance_by_position"])]
        return Response(200, ("\n".join(lines) + "\n").encode(), "text/plain; version=0.0.4; charset=utf-8")

    async def models(self, req: Request) -> Response:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "glm5next",
                "root": self.model_name, "parent": None, "max_model_len": self.engine.max_model_len}
        return Response.json({"object": "list", "data": [card]})

    async def completions(self, req: Request) -> Response | StreamingResponse:
        body = _Body(req)
        self._check_model(body)
        prompt = self._prompt(body.data.get("prompt"))
        body.unsupported(echo=False, suffix="", best_of=1)
        top = body.get("logprobs", "int", upto=MAX_TOP_LOGPROBS)
        return await self._run(body, "cmpl", prompt, body.get("max_tokens", "int"), top, chat=False)

    async def chat(self, req: Request) -> Response | StreamingResponse:
        body = _Body(req)
        self._check_model(body)
        messages = self._messages(body.get("messages", "list", required=True))
        body.unsupported(tools=[], functions=[], response_format={"type": "text"})
        try:
            prompt = self.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as e:  # template errors (jinja2 or the built-in renderer)
            raise ApiError(400, f"the messages could not be rendered with the chat template: {e}",
                           param="messages") from None
        top = body.get("top_logprobs", "int", 0, upto=MAX_TOP_LOGPROBS)
        if not body.get("logprobs", "bool", False):
            if top:
                raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
            top = None
        max_tokens = body.get("max_completion_tokens", "int")
        max_tokens = body.get("max_tokens", "int") if max_tokens is None else max_tokens
        return await self._run(body, "chatcmpl", prompt, max_tokens, top, chat=True)

    # ---------------------------------------------------------------- inputs
    def _check_model(self, body: _Body) -> None:
        model = body.get("model", "str")
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist (this server serves `{self.model_name}`)",
                           param="model", code="model_not_found")

    @staticmethod
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

    @staticmethod
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
                raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                               param="messages")
            out.append({"role": m["role"], "content": content})
        return out

    def _params(self, body: _Body, max_tokens: int | None, top: int | None) -> SamplingParams:
        body.unsupported(n=1, presence_penalty=0, frequency_penalty=0, repetition_penalty=1, logit_bias={})
        kw = {k: v for k, v in (
            ("temperature", body.get("temperature", "float")), ("top_p", body.get("top_p", "float")),
            ("min_p", body.get("min_p", "float")), ("top_k", body.get("top_k", "int")),
            ("seed", body.get("seed", "int")), ("ignore_eos", body.get("ignore_eos", "bool")),
            ("skip_special_tokens", body.get("skip_special_tokens", "bool")),
        ) if v is not None}
        if "seed" in kw and not -(2**63) <= kw["seed"] < 2**64:
            raise ApiError(400, "'seed' must fit in 64 bits", param="seed")
        stop = body.data.get("stop")  # SamplingParams checks the items
        if stop is not None and not isinstance(stop, (str, list)):
            raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")
        if stop:
            kw["stop"] = stop
        if body.get("stop_token_ids", "list") is not None:
            kw["stop_token_ids"] = body.data["stop_token_ids"]
        if top is not None:
            kw["logprobs"] = top
        try:
            return SamplingParams(max_tokens=max_tokens if max_tokens is not None else 1, **kw)
        except ValueError as e:
            m = re.match(r"(\w+)=", str(e))
            raise ApiError(400, str(e), param=m.group(1) if m else None) from None

    # ------------------------------------------------------------ generating
    async def _run(self, body: _Body, prefix: str, prompt, max_tokens, top, chat: bool):
        stream = body.get("stream", "bool", False)
        options = body.get("stream_options", "dict")
        if options is not None and not stream:
            raise ApiError(400, "'stream_options' needs 'stream': true", param="stream_options")
        params = self._params(body, max_tokens, top)
        try:
            ids = self.engine.validate(prompt, params)
        except ValueError as e:
            raise ApiError(400, str(e), param="messages" if chat else "prompt") from None
        if max_tokens is None:
            params.max_tokens = self.engine.max_model_len - len(ids)
        rid = f"{prefix}-{uuid.uuid4().hex}"
        base = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name}
        if stream:
            usage = bool(options and options.get("include_usage"))
            return StreamingResponse(self._stream(base, ids, params, chat, usage))
        last = None
        agen = self.engine.generate(ids, params, rid)
        try:
            async for last in agen:
                pass
        finally:
            await agen.aclose()
        c = last.outputs[0]
        lp = self._logprobs(c.token_ids, c, 0, chat, 0)[0] if top is not None else None
        content = {"message": {"role": "assistant", "content": c.text}} if chat else {"text": c.text}
        choice = {"index": 0, **content, "logprobs": lp, "finish_reason": c.finish_reason}
        return Response.json({**base, "choices": [choice], "usage": self._usage(ids, c)})

    async def _stream(self, base: dict, ids: list[int], params: SamplingParams, chat: bool, usage: bool):
        base = {**base, "object": "chat.completion.chunk" if chat else "text_completion"}
        extra = {"usage": None} if usage else {}

        def chunk(piece: dict, finish=None, logprobs=None) -> bytes:
            choice = {"index": 0, **piece, "logprobs": logprobs, "finish_reason": finish}
            return _sse({**base, "choices": [choice], **extra})

        agen = self.engine.generate(ids, params, base["id"])
        sent_text = sent_tokens = offset = 0
        last = None
        try:
            if chat:
                yield chunk({"delta": {"role": "assistant", "content": ""}})
            async for last in agen:
                c = last.outputs[0]
                delta, sent_text = c.text[sent_text:], max(sent_text, len(c.text))
                lp = None
                if params.logprobs is not None and len(c.token_ids) > sent_tokens:
                    lp, offset = self._logprobs(c.token_ids[sent_tokens:], c, sent_tokens, chat, offset)
                sent_tokens = len(c.token_ids)
                if delta or lp is not None or c.finish_reason is not None:
                    piece = {"delta": {"content": delta} if delta else {}} if chat else {"text": delta}
                    yield chunk(piece, c.finish_reason, lp)
            if usage and last is not None:
                yield _sse({**base, "choices": [], "usage": self._usage(ids, last.outputs[0])})
        except Exception as e:  # a failure mid-stream: tell the client in-band
            logger.exception("stream %s failed", base["id"])
            yield _sse({"error": {"message": str(e) or repr(e), "type": "server_error", "param": None, "code": None}})
        finally:
            await agen.aclose()
        yield b"data: [DONE]\n\n"

    # --------------------------------------------------------------- outputs
    @staticmethod
    def _usage(ids: list[int], c) -> dict:
        return {"prompt_tokens": len(ids), "completion_tokens": len(c.token_ids),
                "total_tokens": len(ids) + len(c.token_ids)}

    def _text(self, token_id: int) -> str:
        if token_id not in self._token_text:
            self._token_text[token_id] = self.engine.tokenizer.decode([token_id])
        return self._token_text[token_id]

    def _logprobs(self, token_ids: list[int], c, start: int, chat: bool, offset: int):
        """The logprobs object of `token_ids` (positions from `start` of the output) and the next text offset."""
        lps = (c.logprobs or [])[start:start + len(token_ids)]
        tops = (c.top_logprobs or [])[start:start + len(token_ids)]
        tops += [[]] * (len(lps) - len(tops))
        if chat:
            def entry(t: int, lp: float) -> dict:
                s = self._text(t)
                return {"token": s, "logprob": _finite(lp), "bytes": list(s.encode())}

            content = [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in top]}
                       for t, lp, top in zip(token_ids, lps, tops)]
            return {"content": content}, offset
        tokens, offsets, top_dicts = [], [], []
        for t, lp, top in zip(token_ids, lps, tops):
            s = self._text(t)
            tokens.append(s)
            offsets.append(offset)
            offset += len(s)
            d = {self._text(i): _finite(v) for i, v in top}
            d.setdefault(s, _finite(lp))
            top_dicts.append(d)
        return {"tokens": tokens, "token_logprobs": [_finite(x) for x in lps], "top_logprobs": top_dicts,
                "text_offset": offsets}, offset


async def start_server(engine, model_name: str, host: str = "127.0.0.1", port: int = 8000, **kwargs) -> HTTPServer:
    """The OpenAI-compatible server over `engine`, listening (port 0: an ephemeral port, see `.port`)."""
    engine.start()
    return await HTTPServer(OpenAIApp(engine, model_name), error_response, host, port, **kwargs).start()
