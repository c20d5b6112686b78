"""The offline entry point: `LLM(model_dir).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.backbone import Glm5NextModel
from ..tokenizer import Tokenizer
from .cache import ModelCache
from .runner import Runner
from .scheduler import BlockManager, Request, Scheduler
from .sampler import SamplingParams, sample

__all__ = ["LLM", "SamplingParams", "CompletionOutput", "RequestOutput"]

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


@dataclass
class CompletionOutput:
    """One generated continuation."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    """'stop' (EOS, stop token or stop string), 'length' (max_tokens or context), or None."""


@dataclass
class RequestOutput:
    """The result of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool


class LLM:
    """GLM-5.3-Flash for offline generation on one device."""

    def __init__(
        self,
        model: str,
        dtype: str = "bfloat16",
        device: str | None = None,
        max_model_len: int | None = None,
        block_size: int = 16,
        prefill_chunk: int = 2048,
        max_num_seqs: int = 256,
        progress: bool = True,
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r}: choose one of {sorted(_DTYPES)}")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available")
        self.dtype = _DTYPES[dtype]
        self.device = torch.device(device)
        self.model = Glm5NextModel.from_pretrained(model, self.dtype, self.device, progress=progress)
        self.config = self.model.config
        self.tokenizer = Tokenizer.from_dir(model)
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        if self.max_model_len > self.config.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={self.config.max_position_embeddings}"
            )
        self.block_size = block_size
        self.prefill_chunk = prefill_chunk
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = set(self.tokenizer.eos_token_ids or self.config.eos_token_ids)

    # ------------------------------------------------------------------ inputs
    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = [int(t) for t in prompt["prompt_token_ids"]]
            bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})")
            return prompt.get("prompt"), ids
        raise ValueError("a prompt is a string or a dict with 'prompt_token_ids'")

    # ---------------------------------------------------------------- generate
    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in order."""
        single = isinstance(prompts, (str, dict))
        prompts = [prompts] if single else list(prompts)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        params = [p or SamplingParams() for p in params]
        inputs = [self._prompt_ids(p) for p in prompts]
        for i, (_, ids) in enumerate(inputs):
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            if len(ids) >= self.max_model_len:
                raise ValueError(
                    f"prompt {i} has {len(ids)} tokens; the context holds {self.max_model_len} "
                    f"(max_model_len), leaving no room to generate"
                )
        budgets = [min(p.max_tokens, self.max_model_len - len(ids)) for p, (_, ids) in zip(params, inputs)]
        blocks = sum(-(-(len(ids) + b) // self.block_size) for (_, ids), b in zip(inputs, budgets))
        cache = ModelCache(self.config, blocks, self.block_size, len(prompts), self.dtype, self.device,
                           include_mtp=False)
        runner = Runner(self.model, cache)
        sched = Scheduler(BlockManager(blocks, len(prompts), self.block_size), self.max_num_seqs, self.prefill_chunk)
        reqs = [Request(str(i), list(ids), b) for i, ((_, ids), b) in enumerate(zip(inputs, budgets))]
        for r in reqs:
            sched.add_request(r)
        gens = [torch.Generator().manual_seed(p.seed) if p.seed is not None else None for p in params]
        outs = [CompletionOutput(0, "", [], None) for _ in prompts]
        bar = _progress(len(prompts), use_tqdm)
        while sched.has_unfinished:
            out = sched.schedule()
            if not out.scheduled:
                raise RuntimeError("the scheduler could not place any request in the cache")
            items = [(r.token_ids, r.num_computed, n, r.slot, r.block_ids) for r, n in out.scheduled]
            logits = runner.execute(items, len(out.decodes))
            sampled = {}
            for row, (r, n) in enumerate(out.scheduled):
                if r.num_computed + n == len(r.token_ids):  # the prompt is complete: a new token
                    i = int(r.request_id)
                    sampled[r.request_id] = sample(logits[row], params[i], gens[i])
            ended = {r.request_id for r in sched.update(out, sampled)}
            for rid in sampled:
                i = int(rid)
                outs[i].token_ids = reqs[i].output_token_ids
                reason = "length" if rid in ended else self._finish(outs[i], params[i])
                if reason is not None:
                    outs[i].finish_reason = reason
                    if rid not in ended:
                        sched.finish(rid, reason)
                    bar.update(1)
        bar.close()
        results = []
        for i, (text, ids) in enumerate(inputs):
            if outs[i].finish_reason != "stop" or not params[i].stop:
                outs[i].text = self.tokenizer.decode(outs[i].token_ids, skip_special_tokens=True)
            results.append(RequestOutput(str(i), text, ids, [outs[i]], True))
        return results

    def _finish(self, out: CompletionOutput, p: SamplingParams) -> str | None:
        """'stop' when the newest token or the text so far ends the request, else None."""
        tok = out.token_ids[-1]
        if (tok in self.eos_token_ids and not p.ignore_eos) or tok in p.stop_token_ids:
            return "stop"
        if p.stop:
            text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            hits = [text.find(s) for s in p.stop if s in text]
            if hits:
                out.text = text[: min(hits)]
                return "stop"
        return None


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")

