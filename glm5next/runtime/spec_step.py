"""One engine step with MTP speculative decoding (eager).

Decoding requests verify q = k + 1 tokens (their last token and k drafts) beside prefill chunks in
one trunk step. Each verify row keeps its accepted drafts and one more token; the KDA states then
advance over exactly the accepted tokens (`Runner.commit_verify`), and DSA entries written for
rejected tokens lie past the sequence's length, never read, rewritten when real tokens arrive there.
Then the MTP layer catches up over every position whose next token is now known and drafts k tokens
for each request whose prompt is complete.
"""

from __future__ import annotations

import torch

from .draft_graph import DraftRequest
from .speculative import DraftRow, accept_rows


def spec_step(engine) -> list:
    sched, runner, k = engine.scheduler, engine.runner, engine.spec.num_speculative_tokens
    q = k + 1
    out = sched.schedule()
    engine.stats["preemptions"] += len(out.preempted)
    for r in out.preempted:
        live = engine._live.get(r.request_id)
        if live is not None:
            live.drafts = live.draft_probs = None
    if not out.scheduled:
        raise RuntimeError("the scheduler could not place any request in the cache")
    live_of = engine._live
    items = [(r.token_ids + live_of[r.request_id].drafts, r.num_computed, q, r.slot, r.block_ids) for r in out.decodes]
    items += [(r.token_ids, r.num_computed, n, r.slot, r.block_ids) for r, n in out.prefills]
    replayed = None if out.prefills else runner.verify_graph(items)
    graphed = replayed is not None and engine.draft_graphs is not None
    if replayed is not None:  # a pure verify step of a captured size
        all_logits, hidden = replayed
        starts = [i * q for i in range(len(items) + 1)]
        engine.stats["graph_steps"] += 1
    else:
        with torch.inference_mode():
            hidden, md = runner.execute_verify(items, len(out.decodes), q)
        all_logits, starts = None, md.query_start_loc_cpu
    engine.stats["steps"] += 1
    new: dict[str, list[int]] = {}
    rows: list[DraftRow] = []
    slots, counts, requests = [], [], []
    with torch.inference_mode():
        accepted = _accept(engine, out.decodes, all_logits, hidden, q)
        for i, r in enumerate(out.decodes):
            live = live_of[r.request_id]
            a = starts[i]
            toks = accepted[i]
            st = engine.stats
            st["verify_rows"] += 1
            st["drafted"] += k
            st["accepted"] += len(toks) - 1
            for j in range(len(toks) - 1):
                st["accepted_at"][j] += 1
            new[r.request_id] = toks
            slots.append(r.slot)
            counts.append(len(toks))
            rows.append(DraftRow(r.slot, r.block_ids, r.num_computed, hidden[a : a + len(toks)], toks,
                                 live.params, live.generator, r.request_id))
            requests.append(DraftRequest(r.request_id, toks, len(r.block_ids) * sched.block_manager.block_size,
                                         live.params, len(r.output_token_ids)))
        if graphed:  # commit, catch-up and drafts in one replay, before any block is freed
            drafted = dict(zip((d.request_id for d in requests),
                               engine.draft_graphs.run(runner.graph_size(len(items), len(items)), hidden, requests)))
        else:
            runner.commit_verify(slots, counts)
        done = [(j, r, n) for j, (r, n) in enumerate(out.prefills) if r.num_computed + n == len(r.token_ids)]
        if done:
            last = torch.tensor([starts[len(out.decodes) + j + 1] - 1 for j, _, _ in done], device=hidden.device)
            reqs = [r for _, r, _ in done]
            tokens, _, _ = engine._sample(engine.model.compute_logits(hidden[last]), list(range(len(done))), reqs)
            for r, t in zip(reqs, tokens):
                new[r.request_id] = [t]
        for j, (r, n) in enumerate(out.prefills):
            a, b = starts[len(out.decodes) + j], starts[len(out.decodes) + j + 1]
            complete = r.request_id in new
            nxt = r.token_ids[r.num_computed + 1 : r.num_computed + n + 1] + (new[r.request_id] if complete else [])
            live = live_of[r.request_id]
            rows.append(DraftRow(r.slot, r.block_ids, r.num_computed, hidden[a:b], nxt,
                                 live.params if complete else None, live.generator, r.request_id))
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
        engine.stats["generated_tokens"] += len(toks)
        results.append(engine._output(live, reason))
    # Draft for the requests still decoding; catch the MTP cache up for every row still running.
    if graphed:
        for rid, res in drafted.items():
            if rid in live_of:
                live_of[rid].drafts, live_of[rid].draft_probs = res
        return results
    rows = [r for r in rows if r.request_id in live_of]
    for row, res in zip(rows, engine.drafter.draft(rows)):
        if res is not None:
            live_of[row.request_id].drafts, live_of[row.request_id].draft_probs = res
    return results


def _accept(engine, decodes, all_logits, hidden, q: int) -> list[list[int]]:
    """Every verify row's emitted tokens, decided on the device in one batch (decode rows come first in
    the step, q tokens each)."""
    if not decodes:
        return []
    n, dev = len(decodes), hidden.device
    logits = all_logits[: n * q] if all_logits is not None else engine.model.compute_logits(hidden[: n * q])
    lives = [engine._live[r.request_id] for r in decodes]
    params = [live.params for live in lives]
    probs = None
    if not all(p.greedy for p in params):
        vocab = logits.shape[-1]
        blank = torch.zeros(q - 1, vocab, device=dev)
        probs = torch.stack([live.draft_probs if live.draft_probs is not None else blank for live in lives])
    tokens, counts = accept_rows(
        logits.view(n, q, -1), torch.tensor([live.drafts for live in lives], device=dev), probs,
        engine.sampler.plan(params, dev), torch.tensor([len(r.output_token_ids) for r in decodes], device=dev))
    return [t[:c] for t, c in zip(tokens.tolist(), counts.tolist())]
