"""The OpenAI-compatible ASGI app over an `AsyncLLM` (Starlette): routes, admission, generation with and
without streaming, and draining at shutdown. The event loop only moves bytes: parsing, rendering and
tokenizing run in worker threads, the model in the engine's thread."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..runtime.async_engine import EngineDeadError
from .api import ApiError, GenerateRequest, parse_chat, parse_completion, parse_json
from .metrics import RequestTimer, ServerMetrics
from .middleware import AccessLog, Authorization, HostCheck
from .prompts import PromptBuilder
from .responses import DONE, Logprobs, TokenTexts, sse, usage
from .settings import ServerSettings
from .streaming import ClientGone, EventStream, read_body, unless_disconnected

logger = logging.getLogger("glm5next.server")

PREPARE_THREADS = 4
"""Worker threads that parse, render and tokenize requests, so the event loop never does."""
CLIENT_CLOSED = 499
"""The status logged for a request whose client went away first (no reply reaches it)."""


@dataclass
class _Job:
    """One admitted generation request on its way through the engine."""

    rid: str
    req: GenerateRequest
    ids: list[int]
    base: dict
    """The fields every response object of the request carries."""
    timer: RequestTimer
    logprobs: Logprobs | None
    done: bool = False


class OpenAIServer:
    """The API over `engine` (an AsyncLLM, started by the caller) with `settings`; `asgi` is the app to serve."""

    def __init__(self, engine, settings: ServerSettings) -> None:
        self.engine, self.settings = engine, settings
        self.created = int(time.time())
        self.prompts = PromptBuilder(engine.tokenizer, engine.max_model_len, engine.config.vocab_size)
        self.texts = TokenTexts(engine.tokenizer)
        self.metrics = ServerMetrics(engine, lambda: self.admitted)
        self.admitted = 0
        """Generation requests held now (tokenizing, waiting or running)."""
        self.live: set[str] = set()
        """Ids of the requests in the engine."""
        self.draining = False
        """A shutdown began: new requests are refused."""
        self.closed = False
        """The shutdown's grace ran out: live requests were ended."""
        self._deadline = 0.0
        self._pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="glm5next-prepare")
        routes = [Route("/health", self.health, methods=["GET"]), Route("/metrics", self.metrics_text, methods=["GET"]),
                  Route("/v1/models", self.models, methods=["GET"]),
                  Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
                  Route("/v1/completions", self.completions, methods=["POST"]),
                  Route("/v1/chat/completions", self.chat, methods=["POST"])]
        app = Starlette(routes=routes, exception_handlers={ApiError: _api_error, HTTPException: _http_error,
                                                           Exception: _server_error})
        app = Authorization(app, settings.api_key)
        if settings.allowed_origins:
            app = CORSMiddleware(app, allow_origins=list(settings.allowed_origins), allow_methods=["GET", "POST"],
                                 allow_headers=["Authorization", "Content-Type"])
        self.asgi = AccessLog(HostCheck(app, settings.allowed_hosts), self.metrics, settings.access_log)

    # ---------------------------------------------------------------- routes
    async def health(self, request: Request) -> Response:
        """200 while requests can be served; 503 once the engine died or a shutdown began."""
        if self.engine.errored:
            raise ApiError(503, "the engine stopped: no request can be served", code="engine_dead")
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="server_shutting_down")
        return JSONResponse({"status": "ok"})

    async def metrics_text(self, request: Request) -> Response:
        body, kind = self.metrics.render()
        return Response(body, headers={"Content-Type": kind})

    def _card(self) -> dict:
        name = self.settings.model_name
        return {"id": name, "object": "model", "created": self.created, "owned_by": "glm5next", "root": name,
                "parent": None, "max_model_len": self.engine.max_model_len}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        model_id = request.path_params["model_id"]
        if model_id != self.settings.model_name:
            raise ApiError(404, f"The model `{model_id}` does not exist (this server serves "
                                f"`{self.settings.model_name}`)", param="model", code="model_not_found")
        return JSONResponse(self._card())

    async def completions(self, request: Request):
        return await self._generate(request, chat=False)

    async def chat(self, request: Request):
        return await self._generate(request, chat=True)

    # ------------------------------------------------------------ generating
    async def _generate(self, request: Request, chat: bool):
        arrival = time.monotonic()
        self._admit()
        handed_over = False
        try:
            body = await read_body(request, self.settings.max_body_bytes, self.settings.body_timeout_s)
            loop = asyncio.get_running_loop()
            req, ids = await unless_disconnected(loop.run_in_executor(self._pool, self._prepare, body, chat),
                                                 request.receive)
            if self.closed:
                raise ApiError(503, "the server is shutting down", code="server_shutting_down")
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            base = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                    "model": self.settings.model_name}
            skipped = self.engine.tokenizer.special_token_ids if req.params.skip_special_tokens else frozenset()
            logprobs = Logprobs(self.texts, chat, skipped) if req.logprobs is not None else None
            job = _Job(rid, req, ids, base, RequestTimer(self.metrics, arrival), logprobs)
            if req.stream:
                handed_over = True
                return EventStream(self._events(job), self._release)
            return await unless_disconnected(self._complete(job), request.receive)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        finally:
            if not handed_over:
                self._release()

    def _admit(self) -> None:
        if self.engine.errored:
            raise ApiError(503, "the engine stopped: no request can be served", code="engine_dead")
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="server_shutting_down")
        if self.admitted >= self.settings.max_concurrent_requests:
            raise ApiError(503, f"the server holds its limit of {self.settings.max_concurrent_requests} concurrent "
                                f"requests (--max-concurrent-requests); try again shortly", code="server_overloaded",
                           headers={"Retry-After": "1"})
        self.admitted += 1

    def _release(self) -> None:
        self.admitted -= 1

    def _prepare(self, body: bytes, chat: bool) -> tuple[GenerateRequest, list[int]]:
        """The checked request and its prompt token ids (in a worker thread)."""
        parse = parse_chat if chat else parse_completion
        req = parse(parse_json(body), self.settings.model_name, self.engine.config.vocab_size)
        ids = self.prompts.token_ids(req)
        if req.max_tokens is None:
            req.params.max_tokens = self.engine.max_model_len - len(ids)
        try:
            self.engine.validate(ids, req.params)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        return req, ids

    def _outputs(self, job: _Job):
        """The engine's outputs for `job` (an async generator: closing it aborts the request)."""
        self.live.add(job.rid)
        return self.engine.generate(job.ids, job.req.params, job.rid)

    def _finish(self, job: _Job, reason: str | None) -> None:
        if not job.done:
            job.done = True
            self.live.discard(job.rid)
            job.timer.finished(reason or "abort", len(job.ids))

    async def _complete(self, job: _Job) -> Response:
        last = None
        outputs = self._outputs(job)
        try:
            async for last in outputs:
                job.timer.grew(len(last.outputs[0].token_ids))
        except EngineDeadError as e:
            raise ApiError(503, str(e), code="engine_dead") from None
        finally:
            await outputs.aclose()
            self._finish(job, last.outputs[0].finish_reason if last is not None else None)
        c = last.outputs[0]
        if c.finish_reason == "abort":
            raise ApiError(503, f"the server shut down before the request finished ({len(c.token_ids)} tokens "
                                f"generated)", code="server_shutting_down")
        lp = job.logprobs.build(c.token_ids, c.logprobs or [], c.top_logprobs or []) if job.logprobs else None
        content = {"message": {"role": "assistant", "content": c.text}} if job.req.chat else {"text": c.text}
        choice = {"index": 0, **content, "logprobs": lp, "finish_reason": c.finish_reason}
        return JSONResponse({**job.base, "choices": [choice], "usage": usage(len(job.ids), len(c.token_ids))})

    async def _events(self, job: _Job):
        chat = job.req.chat
        base = {**job.base, "object": "chat.completion.chunk" if chat else "text_completion"}
        extra = {"usage": None} if job.req.include_usage else {}

        def chunk(piece: dict, finish=None, logprobs=None) -> bytes:
            choice = {"index": 0, **piece, "logprobs": logprobs, "finish_reason": finish}
            return sse({**base, "choices": [choice], **extra})

        outputs = self._outputs(job)
        sent_text = sent_tokens = 0
        c = None
        try:
            if chat:
                yield chunk({"delta": {"role": "assistant", "content": ""}})
            async for out in outputs:
                c = out.outputs[0]
                job.timer.grew(len(c.token_ids))
                if c.finish_reason == "abort":
                    raise ApiError(503, f"the server shut down before the request finished ({len(c.token_ids)} "
                                        f"tokens generated)", code="server_shutting_down")
                delta, sent_text = c.text[sent_text:], max(sent_text, len(c.text))
                lp = None
                if job.logprobs is not None and len(c.token_ids) > sent_tokens:
                    n = len(c.token_ids)
                    lp = job.logprobs.build(c.token_ids[sent_tokens:], (c.logprobs or [])[sent_tokens:n],
                                            (c.top_logprobs or [])[sent_tokens:n])
                sent_tokens = len(c.token_ids)
                if delta or lp is not None or c.finish_reason is not None:
                    piece = {"delta": {"content": delta} if delta else {}} if chat else {"text": delta}
                    yield chunk(piece, c.finish_reason, lp)
            if extra and c is not None:
                yield sse({**base, "choices": [], "usage": usage(len(job.ids), len(c.token_ids))})
        except ApiError as e:  # ended mid-stream: the last event says why
            yield sse(e.body())
        except EngineDeadError as e:
            yield sse(ApiError(503, str(e), code="engine_dead").body())
        except Exception as e:
            logger.exception("stream %s failed", job.rid)
            yield sse(ApiError(500, str(e) or repr(e)).body())
        finally:
            await outputs.aclose()
            self._finish(job, c.finish_reason if c is not None else None)
        yield DONE

    # -------------------------------------------------------------- shutdown
    async def drain(self, grace: float) -> None:
        """Refuse new requests, let live ones run up to `grace` seconds, then end the rest: a stream with a
        final error event and `[DONE]`, a plain request with a 503."""
        self.draining = True
        self._deadline = time.monotonic() + grace
        while self.admitted and time.monotonic() < self._deadline:
            await asyncio.sleep(0.02)
        self.closed = True
        for rid in list(self.live):
            await self.engine.abort(rid)
        deadline = time.monotonic() + 5.0  # the ended requests' last events are on their way
        while self.admitted and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def hurry(self) -> None:
        """End the grace of a drain under way now."""
        self._deadline = 0.0


async def _api_error(request: Request, e: ApiError) -> Response:
    return JSONResponse(e.body(), e.status, headers=e.headers)


async def _http_error(request: Request, e: HTTPException) -> Response:
    if e.status_code == 404:
        message = f"no route for {request.url.path}"
    elif e.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path} (allowed: {(e.headers or {}).get('Allow')})"
    else:
        message = str(e.detail)
    return await _api_error(request, ApiError(e.status_code, message, headers=dict(e.headers or {})))


async def _server_error(request: Request, e: Exception) -> Response:
    logger.error("the handler of %s %s failed", request.method, request.url.path, exc_info=e)
    return await _api_error(request, ApiError(500, "internal server error"))
