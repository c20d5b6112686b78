"""One engine step with MTP speculative decoding.

Decoding requests verify q = k + 1 tokens (their last token and k drafts) beside prefill chunks in
one trunk step. Each verify row keeps its accepted drafts and one more token; the KDA states then
advance over exactly the accepted tokens (`Runner.commit_verify`), and DSA entries written for
rejected tokens lie past the sequence's length, never read, rewritten when real tokens arrive there.
Then the MTP layer catches up over every position whose next token is now known and drafts k tokens
for each request whose prompt is complete. A pure verify step of a captured size replays its graph,
and what follows it (commit, catch-up, drafts) replays the post-verify graph (`DraftGraphs`).

The step is split in two. `SpecPlan` is what the scheduler decided; `run_device` does everything
on the device from it — verify, acceptance, commit, first tokens of completed prompts, drafting —
with every decision a function of the plan and of logits that every tensor-parallel rank holds
alike (acceptance and draws are counter-hashed from each request's seed). So under tensor
parallelism rank 0 broadcasts the plan and every rank runs `run_device`; only rank 0 then applies
stops and lengths, updates the scheduler and emits outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..forward import to_device
from .draft_graph import DraftRequest
from .driver import broadcast_spec
from .sampler import SamplingParams
from .speculative import DraftRow, accept_rows


@dataclass
class PlanRow:
    """One request's share of a speculative step."""

    request_id: str
    params: SamplingParams
    """Its sampling parameters, seed fixed."""
    generated: int
    """Tokens it had generated before this step."""
    next_tokens: list[int] = field(default_factory=list)
    """Prefill rows: the token after each position of the chunk (the last one only if it is in the
    prompt); the MTP layer catches up over them."""
    completes: bool = False
    """Prefill rows: the chunk ends the prompt (the step samples the first token)."""


@dataclass
class SpecPlan:
    """What one speculative step runs: decodes (q tokens each, drafts included) then prefill chunks."""

    items: list
    """`Runner` items, token lists cut to what the step reads (`driver.compact`) under tensor parallelism."""
    rows: list[PlanRow]
    num_decodes: int
    q: int
    ended: list[str] = field(default_factory=list)
    """Requests that ended since the previous plan (ranks other than 0 drop their draft state)."""


class DraftState:
    """A request's drafts between steps, on a rank that keeps no `_Live` (ranks other than 0)."""

    def __init__(self, params: SamplingParams) -> None:
        self.drafts: list[int] | None = None
        self.draft_probs: torch.Tensor | None = None
        self.generator = torch.Generator().manual_seed(params.seed)


def spec_step(engine) -> list:
    """Rank 0 (or the only process): schedule, run the step, then stops, scheduler and outputs."""
    sched, k = engine.scheduler, engine.spec.num_speculative_tokens
    q = k + 1
    out = sched.schedule()
    engine.stats["preemptions"] += len(out.preempted)
    live_of = engine._live
    for r in out.preempted:
        live = live_of.get(r.request_id)
        if live is not None:
            live.drafts = live.draft_probs = None
    if not out.scheduled:
        raise RuntimeError("the scheduler could not place any request in the cache")
    items = [(r.token_ids + live_of[r.request_id].drafts, r.num_computed, q, r.slot, r.block_ids) for r in out.decodes]
    items += [(r.token_ids, r.num_computed, n, r.slot, r.block_ids) for r, n in out.prefills]
    rows = [PlanRow(r.request_id, live_of[r.request_id].params, len(r.output_token_ids)) for r in out.decodes]
    for r, n in out.prefills:
        completes = r.num_computed + n == len(r.token_ids)
        rows.append(PlanRow(r.request_id, live_of[r.request_id].params, len(r.output_token_ids),
                            r.token_ids[r.num_computed + 1 : r.num_computed + n + 1], completes))
    plan = SpecPlan(items, rows, len(out.decodes), q, engine._ended)
    engine._ended = []
    if engine.tp.size > 1:
        broadcast_spec(engine, plan)
    new, graphed = run_device(engine, plan, lambda rid: live_of[rid])
    st = engine.stats
    st["steps"] += 1
    st["graph_steps"] += int(graphed)
    for r in out.decodes:
        toks = new[r.request_id]
        st["verify_rows"] += 1
        st["drafted"] += k
        st["accepted"] += len(toks) - 1
        for j in range(len(toks) - 1):
            st["accepted_at"][j] += 1
    # Stops and lengths over the new tokens, in order; what follows a stop is dropped.
    reasons: dict[str, str | None] = {}
    for rid, toks in new.items():
        live = live_of[rid]
        room = live.request.max_tokens - len(live.request.output_token_ids)
        kept, reason = [], None
        for t in toks[:room]:
            kept.append(t)
            if engine._stops(live, t):
                reason = "stop"
                break
        if reason is None and len(kept) == room:
            reason = "length"
        new[rid], reasons[rid] = kept, reason
    ended = {r.request_id for r in sched.update(out, new)}
    results = []
    for rid, toks in new.items():
        live = live_of[rid]
        reason = reasons[rid] or ("length" if rid in ended else None)
        if reason is not None and live.detok is not None and live.detok.flush():
            reason = "stop"
        if reason is not None:
            if rid not in ended:
                sched.finish(rid, reason)
            del live_of[rid]
            engine._ended.append(rid)
        engine.stats["generated_tokens"] += len(toks)
        results.append(engine._output(live, reason))
    return results


def follow_spec(engine, plan: SpecPlan) -> None:
    """A rank other than 0: the device work of the step rank 0 broadcast, over its own draft states."""
    states = engine._draft_states
    for rid in plan.ended:
        states.pop(rid, None)
    for row in plan.rows:
        if row.request_id not in states:
            states[row.request_id] = DraftState(row.params)
    run_device(engine, plan, states.__getitem__)


@torch.inference_mode()
def run_device(engine, plan: SpecPlan, state_of) -> tuple[dict[str, list[int]], bool]:
    """Every device-side part of the step: (each request's new tokens — accepted drafts and the
    target's token for decodes, the first token for completed prompts —, whether it replayed graphs).
    `state_of(request_id)` holds the request's drafts, their probabilities and its draft generator,
    and receives the new drafts."""
    runner = getattr(engine.runner, "runner", engine.runner)  # rank 0's broadcast went with the plan
    items, nd, q = plan.items, plan.num_decodes, plan.q
    decodes, prefills = plan.rows[:nd], plan.rows[nd:]
    replayed = None if prefills else runner.verify_graph(items)
    graphed = replayed is not None and engine.draft_graphs is not None
    if replayed is not None:  # a pure verify step of a captured size
        all_logits, hidden = replayed
        starts = [i * q for i in range(len(items) + 1)]
    else:
        hidden, md = runner.execute_verify(items, nd, q)
        all_logits, starts = None, md.query_start_loc_cpu
    new: dict[str, list[int]] = {}
    drafting: list[DraftRow] = []
    for i, (toks, row) in enumerate(zip(_accept(engine, decodes, items, all_logits, hidden, q, state_of), decodes)):
        new[row.request_id] = toks
        _, c, _, slot, blocks = items[i]
        state = state_of(row.request_id)
        drafting.append(DraftRow(slot, blocks, c, hidden[starts[i] : starts[i] + len(toks)], toks, row.params,
                                 state.generator, row.request_id))
    if graphed:  # commit, catch-up and drafts in one replay
        bs = runner.cache.block_size
        requests = [DraftRequest(d.request_id, d.next_tokens, len(d.blocks) * bs, d.params, row.generated)
                    for d, row in zip(drafting, decodes)]
        drafted = engine.draft_graphs.run(runner.graph_size(len(items), len(items)), hidden, requests)
    else:
        runner.commit_verify([d.slot for d in drafting], [len(d.next_tokens) for d in drafting])
    done = [(j, row) for j, row in enumerate(prefills) if row.completes]
    if done:
        last = to_device([starts[nd + j + 1] - 1 for j, _ in done], torch.int64, hidden.device)
        first = _sample(engine, engine.model.compute_logits(hidden[last]), [row for _, row in done])
        for (_, row), t in zip(done, first):
            new[row.request_id] = [t]
    for j, row in enumerate(prefills):
        _, c, _, slot, blocks = items[nd + j]
        nxt = row.next_tokens + (new[row.request_id] if row.completes else [])
        drafting.append(DraftRow(slot, blocks, c, hidden[starts[nd + j] : starts[nd + j + 1]], nxt,
                                 row.params if row.completes else None, state_of(row.request_id).generator,
                                 row.request_id))
    if not graphed:  # catch every row's MTP cache up; draft for those whose prompt is complete
        drafted = engine.drafter.draft(drafting)
    for d, res in zip(drafting, drafted):
        if res is not None:
            state = state_of(d.request_id)
            state.drafts, state.draft_probs = res
    return new, graphed


def _accept(engine, decodes: list[PlanRow], items, all_logits, hidden, q: int, state_of) -> list[list[int]]:
    """Every verify row's emitted tokens, decided on the device in one batch (decode rows come first in
    the step, q tokens each, their drafts the last q - 1 of them)."""
    if not decodes:
        return []
    n, dev = len(decodes), hidden.device
    logits = all_logits[: n * q] if all_logits is not None else engine.model.compute_logits(hidden[: n * q])
    params = [row.params for row in decodes]
    probs = None
    if not all(p.greedy for p in params):
        blank = torch.zeros(q - 1, logits.shape[-1], device=dev)
        probs = torch.stack([state_of(row.request_id).draft_probs if not row.params.greedy else blank
                             for row in decodes])
    drafts = [toks[c + 1 : c + q] for toks, c, *_ in items[:n]]
    tokens, counts = accept_rows(logits.view(n, q, -1), to_device(drafts, torch.int64, dev), probs,
                                 engine.sampler.plan(params, dev),
                                 to_device([row.generated for row in decodes], torch.int64, dev))
    return [t[:c] for t, c in zip(tokens.tolist(), counts.tolist())]


def _sample(engine, logits: torch.Tensor, rows: list[PlanRow]) -> list[int]:
    """The first token of each completed prompt, as a step without speculation draws it."""
    params = [row.params for row in rows]
    if all(p.greedy for p in params):
        return logits.argmax(dim=-1).tolist()
    steps = to_device([row.generated for row in rows], torch.int64, logits.device)
    return engine.sampler.sample(logits, engine.sampler.plan(params, logits.device), steps)[0].tolist()
