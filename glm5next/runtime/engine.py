"""The offline entry point: `LLM(model_dir).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import os
import weakref

import torch.distributed as dist
from tqdm import tqdm

from ..config import Glm5NextConfig
from ..parallel.group import check_divisible
from .engine_args import EngineArgs
from .engine_core import CompletionOutput, LLMEngine, RequestOutput
from .sampler import SamplingParams
from .tp_workers import Workers

__all__ = ["LLM", "EngineArgs", "SamplingParams", "CompletionOutput", "RequestOutput"]


class LLM:
    """GLM-5.3-Flash for offline generation: every prompt of a call is batched continuously by
    the engine, and the results come back in prompt order.

    With `tensor_parallel_size=N` in an ordinary process, the `LLM` starts the N - 1 other ranks as worker
    processes on this host (one device each) and ends them with `shutdown()`, at exit, or when it is
    collected. Under `torchrun` (N processes already), every rank runs the same script and calls
    `generate` with the same prompts; rank 0 schedules and drives the others' forwards, and every rank
    returns rank 0's outputs.
    """

    def __init__(self, model: str | EngineArgs, **kwargs) -> None:
        """The engine for checkpoint folder `model` (or `EngineArgs`), with `kwargs` the `EngineArgs` fields:
        `dtype`, `device`, `max_model_len`, `max_num_seqs`, `speculative_config`, `tensor_parallel_size`, ..."""
        args = EngineArgs.of(model, **kwargs)
        self._shutdown = None
        if args.tensor_parallel_size > 1 and "WORLD_SIZE" not in os.environ and not dist.is_initialized():
            if isinstance(args.model, str):  # refuse a size the model cannot split before starting anything
                check_divisible(Glm5NextConfig.from_file(args.model), args.tensor_parallel_size)
            workers = Workers(args)
            try:
                self.engine = LLMEngine(args)
            except BaseException:
                workers.shutdown()
                raise
            workers.joined()
            self._shutdown = weakref.finalize(self, workers.shutdown, self.engine)
        else:
            self.engine = LLMEngine(args)
        self.model, self.config, self.tokenizer = self.engine.model, self.engine.config, self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """End the worker processes this `LLM` started (nothing under torchrun or on one process)."""
        if self._shutdown is not None:
            self._shutdown()

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """One finished `RequestOutput` per prompt, in order. A prompt is a string, a list of
        token ids, or a dict with 'prompt_token_ids'; `sampling_params` is one for all or a list."""
        single = isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts))
        prompts = [prompts] if single else list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        params = [p or SamplingParams() for p in params]
        for i, p in enumerate(prompts):  # refuse the whole call before anything is queued
            try:
                self.engine.validate(p, params[i])
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        if not self.engine.tp.is_driver:
            results = self.engine.follow()
            if results is None:
                raise RuntimeError("rank 0 stopped generating without results (see its error)")
            return results
        results = None
        try:
            results = self._generate(prompts, params, use_tqdm)
        finally:
            self.engine.release_followers(results)
        return results

    def _generate(self, prompts: list, params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        for rid, p, sp in zip(ids, prompts, params):
            self.engine.add_request(rid, p, sp)
        done: dict[str, RequestOutput] = {}
        bar = _progress(len(prompts), use_tqdm)
        try:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            for rid in ids:
                if rid not in done:
                    self.engine.abort_request(rid)
        return [done[rid] for rid in ids]


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    return tqdm(total=total, desc="generate", unit="req")
