"""Scheduler invariants over a simulated engine loop. The fake model writes run tokens into a
fake paged cache and a fake KDA slot state and samples from both, so a mismanaged block, slot,
chunk or recompute changes the tokens, which are compared with a cache-free oracle."""

import random

import pytest

from glm5next.runtime.scheduler import BlockManager, Request, RequestState, Scheduler, SchedulerOutput

def fold(state: int, token: int) -> int:
    """The fake KDA state after one more token."""
    return (state * 31 + token) % 1_000_003


def oracle(prompt: list[int], max_tokens: int, eos: tuple[int, ...] = ()) -> list[int]:
    """The generated tokens, recomputed from the whole sequence every step."""
    tokens = list(prompt)
    while len(tokens) - len(prompt) < max_tokens:
        state = 0
        for t in tokens:
            state = fold(state, t)
        read = sum(t * (p + 1) for p, t in enumerate(tokens))
        tokens.append((state + read + len(tokens)) % 97)
        if tokens[-1] in eos:
            break
    return tokens[len(prompt) :]


class FakeEngine:
    """A fake model over a fake paged cache and fake KDA slots, plus step checks."""

    def __init__(self, sched: Scheduler) -> None:
        bm = sched.block_manager
        self.sched, self.bs = sched, bm.block_size
        self.cache = [None] * (bm.num_blocks * bm.block_size)
        self.states = [None] * bm.num_slots
        self.next_pos: dict[str, int] = {}
        self.steps = self.preemptions = self.peak_running = self.mixed_steps = self.preempted_after_output = 0
        self.prefill_steps: dict[str, int] = {}

    def row(self, req: Request, p: int) -> int:
        return req.block_ids[p // self.bs] * self.bs + p % self.bs

    def step(self, out: SchedulerOutput) -> dict[str, int]:
        """The tokens sampled for the requests whose tokens this step completes."""
        check_step(self.sched, out)
        self.steps += 1
        self.preemptions += len(out.preempted)
        self.peak_running = max(self.peak_running, len(self.sched.running))
        self.mixed_steps += bool(out.decodes and out.prefills)
        for r in out.preempted:
            self.next_pos[r.request_id] = 0
            self.preempted_after_output += bool(r.output_token_ids)
        sampled = {}
        for req, n in out.scheduled:
            start = req.num_computed
            assert start == self.next_pos.get(req.request_id, 0), f"{req.request_id}: chunk skips or repeats tokens"
            self.next_pos[req.request_id] = start + n
            if start < req.num_prompt_tokens:
                self.prefill_steps[req.request_id] = self.prefill_steps.get(req.request_id, 0) + 1
            state = 0 if start == 0 else self.states[req.slot]
            for p in range(start, start + n):
                self.cache[self.row(req, p)] = req.token_ids[p]
                state = fold(state, req.token_ids[p])
            self.states[req.slot], end = state, start + n
            if end == len(req.token_ids):
                read = sum(self.cache[self.row(req, p)] * (p + 1) for p in range(end))
                sampled[req.request_id] = (state + read + end) % 97
        return sampled


def check_step(sched: Scheduler, out: SchedulerOutput) -> None:
    """Raise AssertionError unless `out` and the scheduler's holdings are consistent."""
    bm = sched.block_manager
    assert out.num_tokens <= sched.max_num_batched_tokens, f"step has {out.num_tokens} tokens, over budget"
    assert len(sched.running) <= sched.max_num_seqs, f"{len(sched.running)} requests running"
    assert all(r.is_decode for r in out.decodes), "a decode entry is not a one-token decode"
    assert [r for r, _ in out.scheduled[: len(out.decodes)]] == out.decodes, "a prefill runs before a decode"
    assert not any(r.is_decode for r, _ in out.prefills), "a decode was scheduled as a prefill"
    if out.prefills:
        missing = [r.request_id for r in sched.running if r.is_decode and r not in out.decodes]
        assert not missing, f"prefills ran while decodes {missing} waited"
    assert len({id(r) for r, _ in out.scheduled}) == len(out.scheduled), "a request appears twice in one step"
    for r, n in out.scheduled:
        assert r.state is RequestState.RUNNING and r in sched.running, f"{r.request_id} is not running"
        assert 1 <= n and r.num_computed + n <= len(r.token_ids), f"{r.request_id}: bad chunk {n}"
        assert len(r.block_ids) * bm.block_size >= r.num_computed + n, f"{r.request_id}: too few blocks"
        assert r.slot is not None, f"{r.request_id} has no slot"
    blocks = [b for r in sched.running for b in r.block_ids]
    slots = [r.slot for r in sched.running]
    assert len(blocks) == len(set(blocks)), "two running requests share a block"
    assert len(slots) == len(set(slots)), "two running requests share a slot"
    assert len(blocks) + bm.free_blocks == bm.num_blocks, "blocks leaked"
    assert len(slots) + bm.free_slots == bm.num_slots, "slots leaked"
    assert all(not r.block_ids and r.slot is None for r in sched.waiting), "a waiting request holds cache"


def assert_all_free(bm: BlockManager) -> None:
    """Raise AssertionError unless every block and slot is free."""
    assert bm.free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.free_blocks} blocks leaked"
    assert bm.free_slots == bm.num_slots, f"{bm.num_slots - bm.free_slots} slots leaked"


def make_requests(n: int, seed: int = 0, max_prompt: int = 40) -> list[Request]:
    """`n` requests of mixed prompt lengths (odd ones included) and output lengths."""
    rng = random.Random(seed)
    lens = [rng.randint(1, max_prompt) for _ in range(n)]
    return [Request(f"r{i}", [rng.randrange(97) for _ in range(k)], rng.randint(1, 12)) for i, k in enumerate(lens)]


def simulate(requests, num_blocks=400, num_slots=8, block_size=4, max_num_seqs=8, budget=32, eos=()):
    """Run `requests` to completion; the engine after the run."""
    sched = Scheduler(BlockManager(num_blocks, num_slots, block_size), max_num_seqs, budget, eos)
    for r in requests:
        sched.add_request(r)
    engine = drain(sched, FakeEngine(sched))
    assert_all_free(sched.block_manager)
    return engine


def drain(sched: Scheduler, engine: FakeEngine) -> FakeEngine:
    """Run steps until every request has ended; the engine after the run."""
    while sched.has_unfinished:
        out = sched.schedule()
        assert out.num_tokens and engine.steps < 10_000, "no progress while requests remain"
        for r in sched.update(out, engine.step(out)):
            assert engine.next_pos[r.request_id] == len(r.token_ids) - 1, f"{r.request_id}: not every token ran"
    return engine


CONFIGS = {
    "roomy": dict(),
    "budget-7-chunks-prefills": dict(budget=7),
    "one-seq-at-a-time": dict(max_num_seqs=1),
    "slots-fewer-than-seqs": dict(num_slots=3),
    "block-size-16": dict(block_size=16, num_blocks=100),
    "tight-blocks": dict(num_blocks=16),
    "tight-blocks-budget-5": dict(num_blocks=14, budget=5, max_num_seqs=5),
}


@pytest.mark.parametrize("config", list(CONFIGS.values()), ids=list(CONFIGS))
def test_every_request_completes_with_oracle_tokens(config):
    requests = make_requests(30)
    engine = simulate(requests, **config)
    assert (engine.preemptions > 0) == ("num_blocks" in config and config["num_blocks"] < 20)
    for r in requests:
        assert r.state is RequestState.FINISHED and r.finish_reason == "length"
        assert len(r.output_token_ids) == r.max_tokens
        assert r.output_token_ids == oracle(r.prompt_token_ids, r.max_tokens), r.request_id


@pytest.mark.parametrize("seqs,slots,peak", [(8, 8, 8), (1, 8, 1), (8, 3, 3), (5, 6, 5)],
                         ids=["seqs-8", "seqs-1", "slots-3", "seqs-5-slots-6"])
def test_running_requests_reach_but_never_pass_the_bound(seqs, slots, peak):
    engine = simulate(make_requests(30), num_slots=slots, max_num_seqs=seqs)
    assert engine.peak_running == peak


def test_long_prompt_prefilled_in_chunks_beside_decodes():
    short, long = Request("short", [1, 2, 3], 12), Request("long", list(range(37)), 2)
    sched = Scheduler(BlockManager(64, 4, 4), 4, 8)
    sched.add_request(short)
    engine = FakeEngine(sched)
    sched.update(out := sched.schedule(), engine.step(out))
    sched.add_request(long)
    drain(sched, engine)
    assert engine.prefill_steps["long"] == 6  # 37 tokens, 7 a step beside one decode
    assert engine.mixed_steps >= 5
    assert long.output_token_ids == oracle(long.prompt_token_ids, 2)
    assert_all_free(sched.block_manager)


def test_preempted_requests_match_a_roomy_run():
    tight, roomy = make_requests(20, seed=3), make_requests(20, seed=3)
    engine = simulate(tight, num_blocks=14, budget=16)
    simulate(roomy)
    assert engine.preemptions > 0 and engine.preempted_after_output > 0 and any(r.num_preemptions for r in tight)
    for a, b in zip(tight, roomy):
        assert a.token_ids == b.token_ids, a.request_id


def test_preemption_takes_the_youngest_and_requeues_it_first():
    sched = Scheduler(BlockManager(4, 4, 4), 4, 64)
    old, young = Request("old", [1, 2, 3, 4], 8), Request("young", [5, 6, 7], 8)
    sched.add_request(old), sched.add_request(young)
    engine = FakeEngine(sched)
    while not engine.preemptions:
        sched.update(out := sched.schedule(), engine.step(out))
    assert out.preempted == [young] and list(sched.waiting) == [young] and sched.running == [old]
    assert young.num_computed == 0 and young.slot is None and not young.block_ids


def test_eos_finishes_early():
    requests = make_requests(30, seed=1)
    eos = (5, 40)
    simulate(requests, num_blocks=20, eos=eos)
    assert any(r.finish_reason == "stop" for r in requests)
    for r in requests:
        assert r.output_token_ids == oracle(r.prompt_token_ids, r.max_tokens, eos), r.request_id
        assert (r.output_token_ids[-1] in eos) == (r.finish_reason == "stop")


def three_steps_into(seed: int):
    """Twelve requests on four slots after three steps: some running, some waiting."""
    requests = make_requests(12, seed=seed)
    sched = Scheduler(BlockManager(200, 4, 4), 4, 16)
    for r in requests:
        sched.add_request(r)
    engine = FakeEngine(sched)
    for _ in range(3):
        sched.update(out := sched.schedule(), engine.step(out))
    return requests, sched, engine


def test_abort_waiting_and_running_frees_everything():
    requests, sched, engine = three_steps_into(2)
    running, waiting = sched.running[1], sched.waiting[-1]
    free, held = sched.block_manager.free_blocks, len(running.block_ids)
    assert sched.abort(running.request_id) and sched.abort(waiting.request_id)
    assert sched.block_manager.free_blocks == free + held and held > 0
    assert running.slot is None and not running.block_ids and running not in sched.running + list(sched.waiting)
    assert waiting not in sched.waiting and waiting.state is RequestState.ABORTED
    assert not sched.abort(running.request_id) and not sched.abort("no-such-request")
    drain(sched, engine)
    assert [r for r in requests if r.state is RequestState.ABORTED] == sorted([running, waiting], key=requests.index)
    assert all(r.state is RequestState.FINISHED for r in requests if r not in (running, waiting))
    assert_all_free(sched.block_manager)


def test_finish_ends_running_and_waiting_requests():
    """The engine stops a request on a stop string or token; with asynchronous scheduling the request may be
    waiting again (preempted) by the time its stop token lands."""
    _, sched, engine = three_steps_into(4)
    running, waiting = sched.running[0], sched.waiting[0]
    sched.finish(running.request_id, "stop")
    sched.finish(waiting.request_id, "stop")
    for r in (running, waiting):
        assert r.state is RequestState.FINISHED and r.finish_reason == "stop" and r.slot is None
        assert r not in sched.running and r not in sched.waiting and r.request_id not in sched.requests
    drain(sched, engine)
    assert_all_free(sched.block_manager)


def test_abort_between_schedule_and_update_is_skipped():
    sched = Scheduler(BlockManager(32, 2, 4), 2, 16)
    a, b = Request("a", [1, 2, 3], 4), Request("b", [4, 5], 4)
    sched.add_request(a), sched.add_request(b)
    engine = FakeEngine(sched)
    sampled = engine.step(out := sched.schedule())
    sched.abort("a")
    sched.update(out, sampled)
    assert a.output_token_ids == [] and len(b.output_token_ids) == 1
    drain(sched, engine)
    assert_all_free(sched.block_manager)


def test_block_manager_allocates_and_frees():
    bm = BlockManager(5, 1, 4)
    a, b = Request("a", [0], 1), Request("b", [0], 1)
    assert bm.can_allocate(a, 20) and not bm.can_allocate(a, 21)
    bm.allocate(a, 9)
    assert (bm.free_blocks, bm.free_slots, len(a.block_ids)) == (2, 0, 3)
    assert not bm.can_allocate(b, 1), "no slot left"
    bm.free(a)
    assert_all_free(bm)
    with pytest.raises(RuntimeError):
        bm.allocate(a, 21)
    bm.allocate(b, 1)
    b.block_ids.append(4)  # not handed out
    with pytest.raises(RuntimeError, match="not allocated"):
        bm.free(b)


def test_rejects_requests_it_cannot_run():
    sched = Scheduler(BlockManager(4, 1, 4), 1, 8)
    with pytest.raises(ValueError, match="more than"):
        sched.add_request(Request("big", list(range(14)), 4))
    sched.add_request(Request("fits", list(range(14)), 3))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(Request("fits", [1], 1))
    with pytest.raises(ValueError, match="non-empty"):
        sched.add_request(Request("empty", [], 1))


def _running_pair():
    sched = Scheduler(BlockManager(8, 2, 4), 2, 4)
    a, b = Request("a", [1, 2, 3], 2), Request("b", [4, 5, 6], 2)
    sched.add_request(a), sched.add_request(b)
    return sched, sched.schedule(), a, b  # a: 3 tokens, b: 1 token (the budget)


def test_update_requires_a_token_for_completed_requests():
    sched, out, a, b = _running_pair()
    with pytest.raises(KeyError, match="no token"):
        sched.update(out, {})


# Counter-examples: the checks above can fail.
BREAKAGES = {
    "over-budget": (lambda out, a, b: out.prefills.__setitem__(1, (b, 3)), "over budget"),
    "shared-block": (lambda out, a, b: b.block_ids.__setitem__(0, a.block_ids[0]), "share a block"),
    "request-twice": (lambda out, a, b: out.prefills.__setitem__(1, (a, 1)), "twice"),
}


@pytest.mark.parametrize("breakage,message", list(BREAKAGES.values()), ids=list(BREAKAGES))
def test_check_step_catches_a_broken_step(breakage, message):
    sched, out, a, b = _running_pair()
    breakage(out, a, b)
    with pytest.raises(AssertionError, match=message):
        check_step(sched, out)


def test_leak_check_catches_a_held_block():
    bm = BlockManager(4, 2, 4)
    bm.allocate(Request("a", [1], 1), 1)
    with pytest.raises(AssertionError, match="leaked"):
        assert_all_free(bm)
