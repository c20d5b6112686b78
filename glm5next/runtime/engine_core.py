"""The engine: requests in, one model step at a time, incremental outputs out.

`LLMEngine` owns the scheduler (what runs), the runner (how it runs: CUDA
graphs for pure-decode steps), the cache it sized from a memory budget, the
device-side sampler, and per-request detokenization and stop checks. Both
`LLM.generate` and the asynchronous engine behind the server drive it.

Plain steps are scheduled asynchronously (`async_scheduling`, the default on one process without speculative
decoding): step n + 1 is planned and launched while step n runs, its rows' last tokens read on the device from
step n's samples, and step n's outputs follow once its tokens are on the host, so the GPU does not wait for the
host between steps. A request that stopped at step n has run one token too many in step n + 1; it is dropped.

At startup on a GPU (`EngineArgs.warmup`) dummy requests run a full prefill step and a mixed step through the
step loop, so the kernels those steps compile are ready before the first request; the engine is then as built.

With `tensor_parallel_size=N` (under `torchrun`, one process per device) every rank builds the
engine over its shards; rank 0 schedules and drives the others' forwards (see `driver`), and the
other ranks serve in `follow()`.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from ..forward import to_device
from ..model.backbone import Glm5NextModel
from ..parallel.collectives import min_int
from ..parallel.group import init_tensor_parallel, local_rank
from ..specialized_decode import build_executor
from ..tokenizer import Tokenizer
from .batch_sampler import BatchSampler
from .cache import allocate_cache, zero_usable
from .cache_plan import plan_cache
from .detokenizer import IncrementalDetokenizer
from .engine_args import EngineArgs
from .draft_graph import DraftGraphs
from .driver import DrivenRunner, follow
from .runner import Runner, TokenPatch, check_capture_sizes
from .sampler import SamplingParams
from .scheduler import BlockManager, Request, Scheduler
from .spec_step import follow_spec, spec_step
from .speculative import MtpDrafter, SpeculativeConfig

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}

PLACEHOLDER = -1
"""A generated token whose value is still on the device: its step is in flight (asynchronous scheduling)."""


@dataclass
class CompletionOutput:
    """One generated continuation, cumulative."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    """'stop' (EOS, stop token or stop string), 'length' (max_tokens or context), 'abort', or None."""
    logprobs: list[float] | None = None
    """The raw (pre-temperature) log-probability of each chosen token, when asked for."""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    """The `logprobs` most likely (token id, log-probability) pairs at each position, when asked for."""


@dataclass
class RequestOutput:
    """The state of one request after a step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool


@dataclass
class _Live:
    """What the engine keeps per request beside the scheduler's `Request`."""

    request: Request
    prompt: str | None
    params: SamplingParams
    """The request's parameters with its seed fixed."""
    detok: IncrementalDetokenizer | None
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    drafts: list[int] | None = None
    """Speculative decoding: the draft tokens the next step verifies."""
    draft_probs: torch.Tensor | None = None
    """[k, vocab] the draft distributions the drafts were drawn from (sampled requests)."""
    generator: torch.Generator | None = None
    """Speculative decoding: the request's own random stream for drafts and acceptance."""


@dataclass
class _InFlight:
    """A launched plain step whose sampled tokens have not reached the host yet."""

    reqs: list[Request]
    """The requests that sampled a token, in step order."""
    places: list[int]
    """Where each one's token goes in its `token_ids` (a `PLACEHOLDER` until the step lands)."""
    ended: set[str]
    """Requests the scheduler ended when the step was planned (their token reached max_tokens)."""
    tokens: torch.Tensor | None
    """[len(reqs)] int64 on the device: what the next step's `TokenPatch` reads."""
    host: list[torch.Tensor]
    """Host copies (pinned on a GPU) of the tokens, then, where asked, the chosen tokens' log-probabilities and
    the top log-probabilities' values and ids; valid once `ready` has passed."""
    ready: torch.cuda.Event | None


class LLMEngine:
    """GLM-5.3-Flash on one device (or one rank of a tensor-parallel group), stepping many requests together."""

    def __init__(self, model: str | Glm5NextModel | EngineArgs, tokenizer: Tokenizer | None = None, **kwargs) -> None:
        """An engine for `model` (a checkpoint folder, a built backbone, or `EngineArgs`), with `kwargs` the
        `EngineArgs` fields (they replace those of given `EngineArgs`)."""
        args = self.args = EngineArgs.of(model, **kwargs)
        model, device = args.model, args.device
        self.spec = SpeculativeConfig.parse(args.speculative_config)
        if not isinstance(args.tensor_parallel_size, int) or isinstance(args.tensor_parallel_size, bool) \
                or args.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={args.tensor_parallel_size!r} must be a positive integer")
        if isinstance(model, Glm5NextModel):
            self.model = model
            self.dtype = model.embed_tokens.dtype
            if args.tensor_parallel_size not in (1, model.tp.size):
                raise ValueError(f"tensor_parallel_size={args.tensor_parallel_size}, but the model was built for "
                                 f"{model.tp.size} ranks")
        else:
            if args.dtype not in DTYPES:
                raise ValueError(f"dtype={args.dtype!r}: choose one of {sorted(DTYPES)}")
            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            if device.startswith("cuda") and not torch.cuda.is_available():
                raise ValueError(f"device={device!r} but CUDA is not available")
            tp = init_tensor_parallel(args.tensor_parallel_size, torch.device(device).type)
            if tp.size > 1 and device == "cuda":
                device = f"cuda:{local_rank()}"
            self.dtype = DTYPES[args.dtype]
            self.model = Glm5NextModel.from_pretrained(model, self.dtype, device,
                                                       progress=args.progress and tp.is_driver,
                                                       tp=tp)
            tokenizer = tokenizer or Tokenizer.from_dir(model)
        self.tp = self.model.tp
        """This process's tensor-parallel rank and group; rank 0 schedules, the others `follow()`."""
        self.device = self.model.embed_tokens.device
        self.config = self.model.config
        self.tokenizer = tokenizer
        self.max_model_len = args.max_model_len or self.config.max_position_embeddings
        if not 1 < self.max_model_len <= self.config.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} must be in [2, max_position_embeddings="
                             f"{self.config.max_position_embeddings}]")
        self.capture_sizes = check_capture_sizes(args.capture_sizes)
        if self.spec:  # verify steps run q = k + 1 tokens per request: capture multiples of q
            q = self.spec.num_speculative_tokens + 1
            self.capture_sizes = tuple(sorted({q * max(1, s // q) for s in self.capture_sizes}))
        self.max_num_batched_tokens = args.step_budget(self.device)
        self.plan = plan_cache(
            self.model, self.max_model_len, args.block_size, args.max_num_seqs, self.max_num_batched_tokens,
            args.num_blocks, args.gpu_memory_utilization, self.capture_sizes[-1] if not args.enforce_eager else 0,
            include_mtp=bool(self.spec),
            verify_tokens=self.spec.num_speculative_tokens + 1 if self.spec else 0,
        )
        if self.tp.size > 1:  # every rank sizes its own memory; all hold what the smallest can
            self.plan = dataclasses.replace(self.plan, num_blocks=min_int(self.plan.num_blocks, self.tp))
        k = self.spec.num_speculative_tokens if self.spec else 0
        if self.spec and self.model.mtp is None:
            raise ValueError("speculative_config method 'mtp' needs a checkpoint with an MTP layer; this one has none")
        self.cache = allocate_cache(self.config, self.plan.num_blocks, args.block_size, args.max_num_seqs, self.dtype,
                                    self.device, include_mtp=bool(self.spec), verify_tokens=k + 1 if k else 0,
                                    tp_size=self.tp.size)

        self.executor = build_executor(self.model, args.decode_backend, args.policy, self.capture_sizes,
                                       args.enforce_eager, k + 1)
        self.runner = Runner(self.model, self.cache, self.max_model_len, self.capture_sizes, self.executor, k + 1)
        if self.device.type == "cuda" and not args.enforce_eager:
            self.runner.capture()
        if self.tp.size > 1 and self.tp.is_driver:
            self.runner = DrivenRunner(self.runner, self.tp)
        self.scheduler = Scheduler(BlockManager(self.plan.num_blocks, args.max_num_seqs, args.block_size),
                                   args.max_num_seqs, self.max_num_batched_tokens)
        self.drafter = None
        self._ended: list[str] = []
        """Speculative decoding: requests ended since the last step's plan (rank 0 tells the others)."""
        self._draft_states: dict = {}
        """Speculative decoding on ranks other than 0: each request's drafts between steps."""
        self.draft_graphs = None
        """Speculative decoding: the post-verify graphs (KDA commit, MTP catch-up, drafts)."""
        if self.spec:
            stages = self.executor.draft_stages if self.executor is not None else None
            self.drafter = MtpDrafter(self.model, self.cache, k, stages)
            self.draft_graphs = DraftGraphs(self.runner, self.drafter, k)
            if self.device.type == "cuda" and not args.enforce_eager:
                self.draft_graphs.capture()
            self.scheduler.verify_tokens, self.scheduler.lookahead = k + 1, k
            if self.max_num_batched_tokens < k + 1:
                raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} cannot hold one "
                                 f"{k + 1}-token verify")
        self.sampler = BatchSampler(self.config.vocab_size)
        self.eos_token_ids = frozenset(
            (tokenizer.eos_token_ids if tokenizer is not None else ()) or self.config.eos_token_ids)
        self._seeds = torch.Generator().manual_seed(args.seed)
        self._live: dict[str, _Live] = {}
        self.stats = {"steps": 0, "graph_steps": 0, "prompt_tokens": 0, "generated_tokens": 0, "preemptions": 0,
                      "verify_rows": 0, "drafted": 0, "accepted": 0, "accepted_at": [0] * k}
        self.overlap = args.async_scheduling and not self.spec and self.tp.size == 1
        """Plain steps scheduled and launched while the step before runs (`_step_overlapped`)."""
        self._in_flight: _InFlight | None = None
        self.host_times = self.runner.host_times
        """Host time of plain steps by part (`HostTimes`): the runner's, which charges `inputs` (a tensor-parallel
        driver's broadcast included) and `launch`; the step loop the rest."""
        if args.warmup or (args.warmup is None and self.device.type == "cuda"):
            self._warm_up()

    @classmethod
    def from_model(cls, model: Glm5NextModel, tokenizer: Tokenizer | None = None, **kwargs) -> "LLMEngine":
        """An engine over an already built backbone (its dtype and device)."""
        return cls(model, tokenizer=tokenizer, **kwargs)

    # ----------------------------------------------------------------- warm-up
    def _warm_up(self) -> None:
        """Step dummy requests through the engine's own step loop once, as vLLM's profile run does, so that the
        kernels of a full prefill step, of the sampler and of a mixed step compile now instead of in the first
        requests' steps (a fresh H100's first 4096-token step took 123.6 s compiling 92 Triton kernel variants,
        `2026-12-07-h100-engine-steps-s43.json`). Graph captures cover pure-decode steps only; the cache plan's
        profile run, one prefill chunk, runs only when the cache is sized from memory. Every rank of a
        tensor-parallel group takes part: rank 0 drives the steps as it drives real ones.

        Nothing is left behind. It runs before any request, so the usable cache is still the zeros
        `allocate_cache` gave it (captures write only the scratch block and slot) and is zeroed again; the
        allocator's free lists are a new manager's; counters are restored; request ids are the warm-up's own and
        gone with its requests; the engine's seed stream is untouched (the requests bring their seeds)."""
        start = time.perf_counter()
        runner = getattr(self.runner, "runner", self.runner)  # the Runner inside rank 0's DrivenRunner
        stats, replays = copy.deepcopy(self.stats), runner.num_replays
        draft_replays = self.draft_graphs.num_replays if self.draft_graphs is not None else 0
        if self.tp.is_driver:
            steps = self._warm_up_steps()
            self.release_followers()
            self._ended = []  # the followers drop the warm-up's draft states themselves
        else:
            self.follow()
            self._draft_states.clear()
        zero_usable(self.cache)
        self.scheduler.block_manager.reset()
        self.stats, runner.num_replays = stats, replays
        if self.draft_graphs is not None:
            self.draft_graphs.num_replays = draft_replays
        self.host_times.reset()
        if self.tp.is_driver:
            logger.info("warm-up (%s) took %.1f s", steps, time.perf_counter() - start)

    def _warm_up_steps(self) -> str:
        """Rank 0's part of `_warm_up`: a step of `rows` sampled prompts sharing `size` tokens (one slot is kept
        free), then one more prompt, of the rest of them, beside their decodes; stepped until every request has
        ended. `size` is the step budget, or `max_model_len` if smaller: the prefill chunk whose activation peak
        the cache plan measured. Returns what it ran, in words."""
        sched = self.scheduler
        size, q, bm = min(self.max_num_batched_tokens, self.max_model_len), sched.verify_tokens, sched.block_manager
        # The longest prompt that can still generate two tokens and whose cache (verify lookahead included) fits.
        longest = max(1, min(self.max_model_len - 2, bm.num_blocks * bm.block_size - q - sched.lookahead))
        rows = max(1, min(self.args.max_num_seqs - 1, size))
        each = max(1, min(size // rows, longest))
        later = max(1, min(size - rows * q, longest))
        ids = torch.randint(self.config.vocab_size, (rows * each + later,),
                            generator=torch.Generator().manual_seed(0)).tolist()
        params = SamplingParams(temperature=1.0, seed=0, max_tokens=2, ignore_eos=True)
        for i in range(rows):
            self.add_request(f"warmup-{i}", ids[i * each : (i + 1) * each], params)
        self.step()  # the prefill step; the next plans the prompt below beside their decodes
        self.add_request(f"warmup-{rows}", ids[rows * each :], dataclasses.replace(params, max_tokens=1))
        while self.has_unfinished_requests():
            self.step()
        return f"{rows} x {each} prompt tokens, then {rows} decodes beside a {later}-token prompt"

    # ------------------------------------------------------------------ inputs
    def validate(self, prompt, params: SamplingParams | None = None) -> list[int]:
        """The prompt's token ids, or a ValueError naming what is wrong with the prompt (or with `params` for
        this engine)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: give prompts as token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
        elif isinstance(prompt, (list, tuple)):
            ids = prompt
        else:
            raise ValueError("a prompt is a string, a list of token ids, or a dict with 'prompt_token_ids'")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt token ids must be integers")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})")
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context holds {self.max_model_len} "
                             f"(max_model_len), leaving no room to generate")
        if self.spec and params is not None and params.logprobs is not None:
            raise ValueError("logprobs are not available with speculative decoding yet")
        return list(ids)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None) -> None:
        """Queue a request; raises ValueError (nothing queued) when the prompt or id is unusable."""
        self._check_driver()
        params = params or SamplingParams()
        if request_id in self._live:
            raise ValueError(f"request id {request_id!r} is already live")
        ids = self.validate(prompt, params)
        if params.seed is None:
            params = dataclasses.replace(params, seed=int(torch.randint(0, 2**62, (), generator=self._seeds)))
        budget = min(params.max_tokens, self.max_model_len - len(ids))
        req = Request(request_id, ids, budget)
        self.scheduler.add_request(req)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens)
        text = prompt if isinstance(prompt, str) else (prompt.get("prompt") if isinstance(prompt, dict) else None)
        self._live[request_id] = _Live(req, text, params, detok)
        if self.spec:
            self._live[request_id].generator = torch.Generator().manual_seed(params.seed)
        self.stats["prompt_tokens"] += len(ids)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a live request, free its cache and return its final output (finish reason
        'abort'); None when it is not live."""
        live = self._live.pop(request_id, None)
        if live is None:
            return None
        self.scheduler.abort(request_id)
        if self.spec:
            self._ended.append(request_id)
        return self._output(live, "abort")

    # ------------------------------------------------------ tensor parallelism
    def follow(self):
        """Ranks other than 0: run the steps rank 0 drives until it releases them; returns what
        rank 0 passed to `release_followers`."""
        on_spec = None
        if self.spec:
            on_spec = lambda plan: follow_spec(self, plan)  # noqa: E731
        return follow(self.runner, self.tp, on_spec)

    def release_followers(self, payload=None) -> None:
        """Rank 0: end the other ranks' `follow()`, which return `payload`; nothing on one process."""
        if self.tp.size > 1:
            self.runner.stop(payload)

    def _check_driver(self) -> None:
        if not self.tp.is_driver:
            raise RuntimeError(f"rank {self.tp.rank} of a tensor-parallel engine follows rank 0: call follow()")

    def has_unfinished_requests(self) -> bool:
        return bool(self._live)

    def num_unfinished(self) -> int:
        return len(self._live)

    def usage(self) -> dict:
        """Requests running and waiting, and the fraction of paged-cache blocks in use; readable from
        another thread (approximate while a step runs)."""
        s, bm = self.scheduler, self.scheduler.block_manager
        return {"running": len(s.running), "waiting": len(s.waiting),
                "cache_usage": 1.0 - bm.free_blocks / bm.num_blocks}

    # -------------------------------------------------------------------- step
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one model step; the outputs of the requests that gained a token (finished ones included). With
        `overlap`, a call launches the next step and then returns the outputs of the one launched before."""
        self._check_driver()
        if not self._live:
            self._in_flight = None  # only ended requests were in it
            return []
        if self.spec:
            return spec_step(self)
        if self.overlap:
            return self._step_overlapped()
        times = self.host_times
        times.start()
        out = self.scheduler.schedule()
        self.stats["preemptions"] += len(out.preempted)
        if not out.scheduled:
            raise RuntimeError("the scheduler could not place any request in the cache")
        items = [(r.token_ids, r.num_computed, n, r.slot, r.block_ids) for r, n in out.scheduled]
        times.lap("schedule")
        replays = self.runner.num_replays
        logits = self.runner.execute(items, len(out.decodes))
        self.stats["graph_steps"] += self.runner.num_replays - replays
        self.stats["steps"] += 1
        rows = [i for i, (r, n) in enumerate(out.scheduled) if r.num_computed + n == len(r.token_ids)]
        reqs = [out.scheduled[i][0] for i in rows]
        tokens, logprobs, tops = self._sample(logits, rows, reqs)
        times.lap("sample")
        ended = {r.request_id for r in self.scheduler.update(out, dict(zip((r.request_id for r in reqs), tokens)))}
        results = [self._gained(self._live[req.request_id], tokens[k], k, logprobs, tops, req.request_id in ended)
                   for k, req in enumerate(reqs)]
        self.stats["generated_tokens"] += len(reqs)
        times.lap("outputs")
        times.steps += 1
        return results

    def _gained(self, live: _Live, token: int, k: int, logprobs: list | None, tops: list | None, length: bool,
                last: int | None = None) -> RequestOutput:
        """The output of a request whose step gave it `token` (row k of the step's logprobs): its stop checks,
        and its end where it stopped or (`length`: the scheduler ended it) reached max_tokens. `last`: the
        token's index in `token_ids`, after which a step still in flight may have run one more (dropped)."""
        req = live.request
        if logprobs is not None and live.params.logprobs is not None:
            live.logprobs.append(logprobs[k])
            live.top_logprobs.append(tops[k][: live.params.logprobs])
        reason = "length" if length else None
        if self._stops(live, token):
            reason = "stop"
        if reason is not None and live.detok is not None and live.detok.flush():
            reason = "stop"
        if reason is not None:
            if last is not None:
                del req.token_ids[last + 1 :]
            if self.scheduler.requests.get(req.request_id) is req:  # not already ended by the scheduler
                self.scheduler.finish(req.request_id, reason)
            req.finish_reason = reason
            del self._live[req.request_id]
        return self._output(live, reason)

    def spec_metrics(self) -> dict:
        """Speculative decoding: acceptance rate, mean accepted length (tokens per verify, bonus included)
        and the acceptance rate at each draft position."""
        st = self.stats
        rows = max(st["verify_rows"], 1)
        return {"num_speculative_tokens": len(st["accepted_at"]), "verify_rows": st["verify_rows"],
                "acceptance_rate": st["accepted"] / max(st["drafted"], 1),
                "mean_accepted_length": 1 + st["accepted"] / rows,
                "acceptance_by_position": [a / rows for a in st["accepted_at"]]}

    def _stops(self, live: _Live, token: int) -> bool:
        p = live.params
        hit = (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        if live.detok is not None and live.detok.add(token):
            hit = True
        return hit

    def _sample(self, logits: torch.Tensor, rows: list[int], reqs: list[Request]):
        """Next tokens (and raw logprobs when any row asks) for `rows` of `logits`; one host sync."""
        if not rows:
            return [], None, None
        return self._lists(self._sample_on_device(logits, rows, reqs))

    def _sample_on_device(self, logits: torch.Tensor, rows: list[int], reqs: list[Request]) -> list[torch.Tensor]:
        """The next tokens [R] of `rows` of `logits`, then, when any row asks for logprobs, the chosen tokens'
        raw log-probabilities [R] and the top ones' values and ids [R, w]: device tensors, no host sync."""
        lg = logits[to_device(rows, torch.int64, logits.device)] if len(rows) != logits.shape[0] else logits
        params = [self._live[r.request_id].params for r in reqs]
        if all(p.greedy for p in params):
            tok = lg.argmax(dim=-1)
        else:
            steps = to_device([len(r.output_token_ids) for r in reqs], torch.int64, lg.device)
            tok, _ = self.sampler.sample(lg, self.sampler.plan(params, lg.device), steps)
        want = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        if want is None:
            return [tok]
        lp = torch.log_softmax(lg, dim=-1)
        top_v, top_i = lp.topk(max(want, 1), dim=-1)
        return [tok, lp.gather(1, tok[:, None]).squeeze(1), top_v, top_i]

    @staticmethod
    def _lists(sampled: list[torch.Tensor]):
        """(tokens, chosen log-probabilities or None, top (id, log-probability) pairs per row or None) as
        Python lists from `_sample_on_device`'s tensors (or their host copies)."""
        if len(sampled) == 1:
            return sampled[0].tolist(), None, None
        tok, chosen, top_v, top_i = sampled
        return tok.tolist(), chosen.tolist(), [list(zip(i, v)) for i, v in zip(top_i.tolist(), top_v.tolist())]

    # ---------------------------------------------------- asynchronous scheduling
    def _step_overlapped(self) -> list[RequestOutput]:
        """Plan and launch the next step while the one launched before runs, then land that one: the GPU
        never waits for the host between plain steps. The next step is planned as if every request of the
        step in flight gained its token (a `PLACEHOLDER` until it lands; the step reads the value on the
        device through a `TokenPatch`); a request that turns out to have stopped has run one token too many,
        which is dropped. The same tokens as one step at a time (greedy and seeded sampling)."""
        times = self.host_times
        times.start()
        before, self._in_flight = self._in_flight, None
        if self.scheduler.has_unfinished:
            out = self.scheduler.schedule()
            self.stats["preemptions"] += len(out.preempted)
            times.lap("schedule")
            if out.scheduled:
                self._in_flight = self._launch(out, before)
            elif before is None:
                raise RuntimeError("the scheduler could not place any request in the cache")
        if before is None:
            return []
        return self._land(before)

    def _launch(self, out, before: _InFlight | None) -> _InFlight:
        """Run the step `out` (its tokens still on the device read there), sample on the device, start the
        copies of the samples to the host, and advance the scheduler as if they were known."""
        times = self.host_times
        items = [(r.token_ids, r.num_computed, n, r.slot, r.block_ids) for r, n in out.scheduled]
        replays = self.runner.num_replays
        logits = self.runner.execute(items, len(out.decodes), patch=self._patch(out, before))
        self.stats["graph_steps"] += self.runner.num_replays - replays
        self.stats["steps"] += 1
        rows = [i for i, (r, n) in enumerate(out.scheduled) if r.num_computed + n == len(r.token_ids)]
        reqs = [out.scheduled[i][0] for i in rows]
        sampled = self._sample_on_device(logits, rows, reqs) if rows else []
        if sampled and sampled[0].is_cuda:
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True) for t in sampled]
            ready = torch.cuda.Event()
            ready.record()
        else:
            host, ready = sampled, None
        places = [len(r.token_ids) for r in reqs]
        ended = self.scheduler.update(out, {r.request_id: PLACEHOLDER for r in reqs})
        times.lap("sample")
        return _InFlight(reqs, places, {r.request_id for r in ended}, sampled[0] if sampled else None, host, ready)

    @staticmethod
    def _patch(out, before: _InFlight | None) -> TokenPatch | None:
        """Where the step `out` runs a token of the step in flight `before`, and that token on the device."""
        if before is None or not before.reqs:
            return None
        index = {id(r): k for k, r in enumerate(before.reqs)}
        at, src, pos = [], [], 0
        for r, n in out.scheduled:
            k = index.get(id(r))
            if k is not None and r.num_computed <= before.places[k] < r.num_computed + n:
                at.append(pos + before.places[k] - r.num_computed)
                src.append(k)
            pos += n
        if not at:
            return None
        dev = before.tokens.device
        return TokenPatch(to_device(at, torch.int64, dev), before.tokens[to_device(src, torch.int64, dev)])

    def _land(self, done: _InFlight) -> list[RequestOutput]:
        """The outputs of the step `done` once its tokens are on the host: each token in place of its
        placeholder, then the stop checks and outputs of a plain step."""
        times = self.host_times
        if done.ready is not None:
            done.ready.synchronize()
        times.lap("sample")
        tokens, logprobs, tops = self._lists(done.host) if done.host else ([], None, None)
        results = []
        for k, req in enumerate(done.reqs):
            live = self._live.get(req.request_id)
            if live is None or live.request is not req:
                continue  # aborted, or stopped at the step before
            req.token_ids[done.places[k]] = tokens[k]
            results.append(self._gained(live, tokens[k], k, logprobs, tops, req.request_id in done.ended,
                                        done.places[k]))
        self.stats["generated_tokens"] += len(results)
        times.lap("outputs")
        times.steps += 1
        return results

    def _output(self, live: _Live, reason: str | None) -> RequestOutput:
        req = live.request
        finished = reason is not None
        text = live.detok.visible(finished) if live.detok is not None else ""
        want = live.params.logprobs is not None
        ids = req.output_token_ids
        while ids and ids[-1] == PLACEHOLDER:  # tokens of a step in flight
            ids.pop()
        comp = CompletionOutput(0, text, ids, reason,
                                list(live.logprobs) if want else None, list(live.top_logprobs) if want else None)
        return RequestOutput(req.request_id, live.prompt, req.prompt_token_ids, [comp], finished)
