"""The engine for servers: per-request streams of incremental outputs, and abort.

The model steps in one worker thread, so the event loop stays free to accept
and answer connections while a step runs. The loop never touches the engine:
it validates a request (which reads only the tokenizer and the config), then
hands `add` and `abort` commands to the worker through a queue; the worker
applies them between steps and posts each step's outputs back to the
request's asyncio queue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from typing import AsyncIterator

from .engine_args import EngineArgs
from .engine_core import LLMEngine, RequestOutput
from .sampler import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine's worker stopped; no request can be served."""


class AsyncLLM:
    """An `LLMEngine` driven by a worker thread, with an asyncio front."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.config = engine.config
        self.max_model_len = engine.max_model_len
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # guards _streams
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._ids = itertools.count()
        self._released = False

    @classmethod
    def from_args(cls, model: str | EngineArgs, **kwargs) -> "AsyncLLM":
        """Load `model` (a checkpoint folder, or `EngineArgs`) into a new engine, with `kwargs` the `EngineArgs`
        fields; no progress bar unless asked for."""
        if not isinstance(model, EngineArgs):
            kwargs.setdefault("progress", False)
        return cls(LLMEngine(EngineArgs.of(model, **kwargs)))

    # ---------------------------------------------------------------- control
    def start(self) -> None:
        """Start the worker thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="glm5next-engine", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        """Stop the worker after its current step (and the other tensor-parallel ranks' loops);
        live streams end with an error."""
        self._stop.set()
        self._commands.put(("wake", None, None))
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
        with self._lock:
            ids = list(self._streams)
        for rid in ids:  # they would wait for outputs forever
            self._post(rid, EngineDeadError("the engine shut down"))
        if not self._released:
            self._released = True
            self.engine.release_followers()

    @property
    def errored(self) -> bool:
        """Whether the worker stopped on an error (the engine can serve nothing more)."""
        return self._error is not None

    def num_unfinished(self) -> int:
        """Requests the engine still holds (read from the worker's side; approximate while a step runs)."""
        return self.engine.num_unfinished()

    def usage(self) -> dict:
        """Requests running and waiting, and the cache's fill (see `LLMEngine.usage`)."""
        return self.engine.usage()

    def validate(self, prompt, params: SamplingParams | None = None) -> list[int]:
        """The prompt's token ids, or a ValueError naming the problem (see `LLMEngine.validate`)."""
        return self.engine.validate(prompt, params)

    # --------------------------------------------------------------- requests
    async def generate(
        self, prompt, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request as its tokens arrive; the last has `finished`.

        Closing the generator early (a client went away) aborts the request.
        """
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped: {self._error!r}")
        params = params or SamplingParams()
        self.validate(prompt, params)
        request_id = request_id or f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already live")
            self._streams[request_id] = (loop, stream)
        self.start()
        self._commands.put(("add", request_id, (prompt, params)))
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(("abort", request_id, None))
            with self._lock:
                self._streams.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        """Abort a live request; its stream ends with a final output whose finish reason is 'abort'."""
        self._commands.put(("abort", request_id, None))

    # ----------------------------------------------------------------- worker
    def _post(self, request_id: str, item) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            try:
                loop.call_soon_threadsafe(stream.put_nowait, item)
            except RuntimeError:  # the client's loop is closed
                pass

    def _apply(self, kind: str, request_id: str, payload) -> None:
        if kind == "add":
            try:
                self.engine.add_request(request_id, *payload)
            except ValueError as e:
                self._post(request_id, e)
        elif kind == "abort":
            out = self.engine.abort_request(request_id)
            if out is not None:
                self._post(request_id, out)

    def _work(self) -> None:
        try:
            while not self._stop.is_set():
                block = not self.engine.has_unfinished_requests()
                try:
                    while True:
                        kind, rid, payload = self._commands.get(block=block)
                        block = False
                        if kind != "wake":
                            self._apply(kind, rid, payload)
                except queue.Empty:
                    pass
                if self._stop.is_set():
                    break
                for out in self.engine.step():
                    self._post(out.request_id, out)
        except BaseException as e:  # a bug in a step: every live stream learns of it
            logger.exception("the engine stopped")
            self._error = e
            with self._lock:
                ids = list(self._streams)
            for rid in ids:
                self._post(rid, EngineDeadError(f"the engine stopped: {e!r}"))
