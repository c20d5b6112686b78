"""Rank 0 drives the other tensor-parallel ranks.

Only rank 0 runs the scheduler, the sampler, detokenization and (when serving) the HTTP front.
Before each model step it broadcasts the step's inputs over the gloo control group; every other
rank (a follower) waits in `follow`, runs the same step on its shards, and discards the logits
(every rank holds the same gathered logits; rank 0 samples from its own). The collectives inside
the forward then meet in the same order on every rank. Rank 0 ends the followers' loop with a
stop message, which may carry a payload (e.g. the outputs of an offline `generate`).
"""

from __future__ import annotations

import dataclasses

import torch

from ..parallel.collectives import broadcast_object
from ..parallel.group import TensorParallel
from .runner import Item, Runner

EXECUTE = "execute"
"""Message kind: run `Runner.execute` with the given items."""
STOP = "stop"
"""Message kind: leave `follow`, returning the payload."""
SPEC = "spec"
"""Message kind: run the device part of a speculative step (`spec_step.SpecPlan`)."""


class TokenTail:
    """The token ids of a sequence from position `start` on, indexed with absolute positions: all
    of a sequence a step reads (`token_ids[start : start + n]`), so a long context is not resent."""

    def __init__(self, start: int, tokens: list[int]) -> None:
        self.start, self.tokens = start, tokens

    def __getitem__(self, s: slice) -> list[int]:
        if not isinstance(s, slice) or s.step is not None or s.start is None or s.start < self.start:
            raise IndexError(f"the step carries tokens from position {self.start} on, not {s!r}")
        stop = None if s.stop is None else s.stop - self.start
        return self.tokens[s.start - self.start : stop]


def compact(items: list[Item]) -> list[Item]:
    """`items` with each token list cut to the tokens the step runs."""
    return [(TokenTail(c, toks[c : c + n]), c, n, slot, blocks) for toks, c, n, slot, blocks in items]


class DrivenRunner:
    """Rank 0's runner under tensor parallelism: `execute` broadcasts the step, then runs it here.
    Everything else reads through to the runner."""

    def __init__(self, runner: Runner, tp: TensorParallel) -> None:
        if not tp.is_driver:
            raise ValueError(f"rank {tp.rank} follows rank 0; only rank 0 drives")
        self.runner, self.tp = runner, tp

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    @torch.inference_mode()
    def execute(self, items: list[Item], num_decodes: int, allow_graph: bool = True) -> torch.Tensor:
        """`Runner.execute` on every rank; the fp32 logits [len(items), vocab]."""
        broadcast_object((EXECUTE, compact(items), num_decodes, allow_graph), self.tp)
        return self.runner.execute(items, num_decodes, allow_graph)

    def stop(self, payload=None) -> None:
        """End the followers' `follow` loops; each returns `payload`."""
        broadcast_object((STOP, payload), self.tp)


def broadcast_spec(engine, plan) -> None:
    """Rank 0: send a speculative step's plan (token lists cut to what the step reads) to the followers."""
    broadcast_object((SPEC, dataclasses.replace(plan, items=compact(plan.items))), engine.tp)


def follow(runner: Runner, tp: TensorParallel, on_spec=None):
    """A follower's loop: run every step rank 0 broadcasts, until it stops; returns the stop's payload.
    `on_spec(plan)` runs a speculative step's device part."""
    if tp.is_driver:
        raise ValueError("rank 0 drives; only the other ranks follow")
    while True:
        kind, *args = broadcast_object(None, tp)
        if kind == STOP:
            return args[0]
        if kind == SPEC and on_spec is not None:
            on_spec(args[0])
        elif kind == EXECUTE:
            runner.execute(*args)
        else:
            raise RuntimeError(f"rank {tp.rank}: unknown step {kind!r} from rank 0")
