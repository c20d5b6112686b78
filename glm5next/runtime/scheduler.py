"""Continuous batching: which requests run which tokens in each step.

Pure host bookkeeping, no tensors. A request's `token_ids` are its prompt
followed by its generated tokens; `num_computed` of them have their caches
written. Each step runs the uncomputed tokens of some running requests:
decodes first (one token each), then prefill chunks under a token budget, so a
long prompt is prefilled across several steps beside running decodes. When the
paged cache runs out, the youngest running request is preempted: its blocks
and KDA slot are freed and it waits, first in line, to be recomputed from
scratch (prompt and generated tokens alike).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable


class RequestState(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False)
class Request:
    """One generation request: its tokens, progress, and the cache it holds."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    token_ids: list[int] = field(init=False)
    """Prompt tokens followed by generated tokens."""
    num_computed: int = 0
    """Leading tokens of `token_ids` whose caches are written."""
    state: RequestState = RequestState.WAITING
    block_ids: list[int] = field(default_factory=list)
    """Paged-cache blocks holding the request's tokens, in order."""
    slot: int | None = None
    """KDA state slot, or None while the request holds no cache."""
    finish_reason: str | None = None
    """'stop' (EOS), 'length' (max_tokens) or 'abort' once the request ends."""
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to run before the next token can be sampled."""
        return len(self.token_ids) - self.num_computed

    @property
    def is_decode(self) -> bool:
        """Whether the next step runs exactly one token after a written cache (the runner's notion)."""
        return self.num_computed > 0 and self.num_uncomputed == 1


class BlockManager:
    """Free lists of paged-cache blocks and KDA state slots, handed to requests."""

    def __init__(self, num_blocks: int, num_slots: int, block_size: int) -> None:
        for name, value in (("num_blocks", num_blocks), ("num_slots", num_slots), ("block_size", block_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        self.num_blocks, self.num_slots, self.block_size = num_blocks, num_slots, block_size
        self.reset()

    def reset(self) -> None:
        """Every block and slot free, handed out in a new manager's order (no request may hold any)."""
        # Lowest ids are handed out first (pop from the end).
        self._free_blocks = list(range(self.num_blocks - 1, -1, -1))
        self._free_slots = list(range(self.num_slots - 1, -1, -1))

    @property
    def free_blocks(self) -> int:
        """Blocks no request holds."""
        return len(self._free_blocks)

    @property
    def free_slots(self) -> int:
        """KDA state slots no request holds."""
        return len(self._free_slots)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, request: Request, num_tokens: int) -> int:
        """Blocks `request` must gain to hold `num_tokens` tokens in all."""
        return max(self.blocks_for(num_tokens) - len(request.block_ids), 0)

    def can_allocate(self, request: Request, num_tokens: int) -> bool:
        """Whether `request` can hold `num_tokens` tokens in all (and a slot) from what is free."""
        has_slot = request.slot is not None or bool(self._free_slots)
        return has_slot and self.blocks_needed(request, num_tokens) <= len(self._free_blocks)

    def allocate(self, request: Request, num_tokens: int) -> None:
        """Grow `request` to hold `num_tokens` tokens, taking a slot if it has none."""
        if not self.can_allocate(request, num_tokens):
            raise RuntimeError(f"request {request.request_id}: cannot hold {num_tokens} tokens "
                               f"({self.free_blocks} blocks and {self.free_slots} slots free)")
        if request.slot is None:
            request.slot = self._free_slots.pop()
        for _ in range(self.blocks_needed(request, num_tokens)):
            request.block_ids.append(self._free_blocks.pop())

    def free(self, request: Request) -> None:
        """Return every block and the slot of `request`."""
        free = set(self._free_blocks)
        bad = [b for b in request.block_ids if b in free or not 0 <= b < self.num_blocks]
        if bad or request.slot in self._free_slots:
            raise RuntimeError(f"request {request.request_id}: blocks {bad} or slot {request.slot} not allocated")
        self._free_blocks.extend(reversed(request.block_ids))
        request.block_ids = []
        if request.slot is not None:
            self._free_slots.append(request.slot)
            request.slot = None


@dataclass
class SchedulerOutput:
    """The work of one step: decodes (one token each) first, then prefill chunks."""

    decodes: list[Request] = field(default_factory=list)
    prefills: list[tuple[Request, int]] = field(default_factory=list)
    """(request, tokens) chunks; the tokens start at the request's `num_computed`."""
    preempted: list[Request] = field(default_factory=list)
    """Requests preempted while planning this step (their caches are void)."""

    @property
    def scheduled(self) -> list[tuple[Request, int]]:
        """Every (request, tokens) of the step, in step order."""
        return [(r, 1) for r in self.decodes] + self.prefills

    @property
    def num_tokens(self) -> int:
        """Tokens in the step."""
        return len(self.decodes) + sum(n for _, n in self.prefills)


class Scheduler:
    """Continuous batching of requests over one `BlockManager`."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 eos_token_ids: Iterable[int] = ()) -> None:
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        self.block_manager = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        """Running requests, oldest admission first."""
        self.requests: dict[str, Request] = {}
        """Unfinished requests by id."""
        self.verify_tokens = 1
        """Tokens each decoding request runs per step (1 + speculative tokens)."""
        self.lookahead = 0
        """Cache positions reserved past a decode's tokens (room for draft-layer writes)."""

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add_request(self, request: Request) -> None:
        """Queue `request` behind every waiting one."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already queued or running")
        if request.state is not RequestState.WAITING or request.num_computed or request.slot is not None:
            raise ValueError(f"request {request.request_id!r} is not a fresh waiting request")
        if not request.prompt_token_ids or not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise ValueError(f"request {request.request_id!r}: needs a non-empty prompt and max_tokens >= 1")
        # The last sampled token is never run, so at most prompt + max_tokens - 1 tokens are cached.
        most = request.num_prompt_tokens + request.max_tokens - 1 + self.verify_tokens - 1 + self.lookahead
        bm = self.block_manager
        if bm.blocks_for(most) > bm.num_blocks:
            raise ValueError(
                f"request {request.request_id!r} may cache {most} tokens, more than the "
                f"{bm.num_blocks} blocks of {bm.block_size} tokens can hold"
            )
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        """The next step's work; blocks for it are allocated, `num_computed` is advanced by `update`."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget >= self.verify_tokens:
            req = self.running[i]
            if req.is_decode:
                if not self._reserve_decode(req, out):
                    break  # it was the youngest and preempted itself
                out.decodes.append(req)
                budget -= self.verify_tokens
            i += 1
        scheduled = set(map(id, out.decodes))
        for req in list(self.running):
            if budget == 0:
                break
            if req.state is not RequestState.RUNNING or req.is_decode:
                continue
            n = self._fit_prefill(req, min(req.num_uncomputed, budget), scheduled, out)
            if n:
                self.block_manager.allocate(req, req.num_computed + n)
                out.prefills.append((req, n))
                scheduled.add(id(req))
                budget -= n
        # A step that preempted has no room to spare: admitting now would only thrash.
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_uncomputed, budget)
            if not self.block_manager.can_allocate(req, n):
                break
            self.waiting.popleft()
            self.block_manager.allocate(req, n)
            req.state = RequestState.RUNNING
            self.running.append(req)
            out.prefills.append((req, n))
            budget -= n
        return out

    def update(self, output: SchedulerOutput, sampled: dict[str, int | list[int]]) -> list[Request]:
        """Advance every request of `output` by its tokens, append the tokens sampled for
        those whose computed tokens now cover `token_ids`, and return the requests that finished.

        A verifying decode may gain several tokens (its accepted drafts, then one more): its caches
        are then valid for its last token and the accepted drafts, so it advances by that many."""
        finished = []
        decodes = set(map(id, output.decodes))
        for req, n in output.scheduled:
            if req.state is not RequestState.RUNNING:
                continue  # aborted between schedule() and update()
            got = sampled.get(req.request_id)
            tokens = got if isinstance(got, list) else ([] if got is None else [got])
            req.num_computed += len(tokens) if id(req) in decodes and len(tokens) > 1 else n
            if req.num_computed < len(req.token_ids):
                continue  # prefill not complete: nothing to sample yet
            if not tokens:
                raise KeyError(f"request {req.request_id!r} completed its tokens but no token was sampled for it")
            req.token_ids.extend(tokens)
            token = tokens[-1]
            if token in self.eos_token_ids:
                self._end(req, RequestState.FINISHED, "stop")
            elif len(req.token_ids) - req.num_prompt_tokens >= req.max_tokens:
                self._end(req, RequestState.FINISHED, "length")
            else:
                continue
            finished.append(req)
        return finished

    def abort(self, request_id: str) -> bool:
        """End a waiting or running request and free its cache; False if it is not live."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        if req.state is RequestState.WAITING:
            self.waiting.remove(req)
        self._end(req, RequestState.ABORTED, "abort")
        return True

    def finish(self, request_id: str, reason: str) -> None:
        """End a request the engine stopped (stop string, stop token) and free its cache: a running one, or a
        waiting one (preempted while the step that sampled its stop token was still running)."""
        req = self.requests[request_id]
        if req.state is RequestState.WAITING:
            self.waiting.remove(req)
        self._end(req, RequestState.FINISHED, reason)

    def _end(self, req: Request, state: RequestState, reason: str) -> None:
        if req.state is RequestState.RUNNING:
            self.running.remove(req)
        self.block_manager.free(req)
        req.state = state
        req.finish_reason = reason
        del self.requests[req.request_id]

    def _preempt(self, out: SchedulerOutput) -> Request:
        victim = self.running.pop()
        self.block_manager.free(victim)
        victim.num_computed = 0
        victim.state = RequestState.WAITING
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)
        return victim

    def _reserve_decode(self, req: Request, out: SchedulerOutput) -> bool:
        """Whether `req` got room for its next step's tokens (and the lookahead), preempting the youngest
        running requests for it."""
        need = req.num_computed + self.verify_tokens + self.lookahead
        while not self.block_manager.can_allocate(req, need):
            if self._preempt(out) is req:
                return False
        self.block_manager.allocate(req, need)
        return True

    def _fit_prefill(self, req: Request, n: int, scheduled: set[int], out: SchedulerOutput) -> int:
        """Tokens of a running prefill that fit, after preempting younger requests not yet in the step."""
        bm = self.block_manager
        while not bm.can_allocate(req, req.num_computed + n):
            victim = self.running[-1]
            if victim is req or id(victim) in scheduled:
                room = (len(req.block_ids) + bm.free_blocks) * bm.block_size - req.num_computed
                return max(min(n, room), 0)
            self._preempt(out)
        return n
