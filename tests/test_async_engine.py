"""The asynchronous engine: concurrent streams each get exactly their own tokens, closing a stream
aborts its request, and a bad request is refused without disturbing the others."""

import asyncio
import time

import pytest

from glm5next.runtime.async_engine import AsyncLLM
from glm5next.runtime.engine_core import LLMEngine
from glm5next.runtime.sampler import SamplingParams
from glm5next.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def engine(tiny_fp32, tiny_dir):
    eng = AsyncLLM(LLMEngine.from_model(tiny_fp32, Tokenizer.from_dir(tiny_dir), max_model_len=128, max_num_seqs=8))
    yield eng
    asyncio.run(eng.shutdown())


def params(i):
    if i % 2:
        return SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=3 + i % 4, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=3 + i % 4, ignore_eos=True)


async def collect(engine, prompt, p, rid=None):
    outs = []
    async for out in engine.generate(prompt, p, rid):
        outs.append(out)
    return outs


def test_concurrent_streams_equal_alone(engine):
    prompts = [f"prompt number {i} " * (1 + i % 3) for i in range(12)]

    async def main():
        alone = [await collect(engine, p, params(i)) for i, p in enumerate(prompts)]
        together = await asyncio.gather(*(collect(engine, p, params(i)) for i, p in enumerate(prompts)))
        return alone, together

    alone, together = asyncio.run(main())
    for i, (a, t) in enumerate(zip(alone, together)):
        assert t[-1].finished and t[-1].outputs[0].finish_reason == "length"
        assert t[-1].outputs[0].token_ids == a[-1].outputs[0].token_ids, i
        assert t[-1].outputs[0].text == a[-1].outputs[0].text
        lens = [len(o.outputs[0].token_ids) for o in t]
        assert lens == sorted(lens) and lens[-1] == params(i).max_tokens
        assert not any(o.finished for o in t[:-1])
    assert engine.num_unfinished() == 0


def test_closing_a_stream_aborts_its_request(engine):
    async def main():
        gen = engine.generate("a long one", SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
        first = await gen.__anext__()
        await gen.aclose()
        return first

    first = asyncio.run(main())
    assert not first.finished
    for _ in range(200):  # the worker applies the abort between steps
        if engine.num_unfinished() == 0:
            break
        time.sleep(0.01)
    bm = engine.engine.scheduler.block_manager
    assert engine.num_unfinished() == 0 and bm.free_blocks == bm.num_blocks and bm.free_slots == bm.num_slots


def test_abort_ends_the_stream_and_bad_requests_are_refused(engine):
    async def main():
        keep = asyncio.ensure_future(collect(engine, "keep going", SamplingParams(temperature=0.0, max_tokens=6,
                                                                                 ignore_eos=True)))
        doomed = engine.generate("stop me", SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True), "doom")
        await doomed.__anext__()
        await engine.abort("doom")
        last = [o async for o in doomed][-1]
        with pytest.raises(ValueError, match="max_model_len"):
            await collect(engine, [1] * 500, SamplingParams())
        with pytest.raises(ValueError, match="empty"):
            await collect(engine, [], SamplingParams())
        return last, await keep

    last, kept = asyncio.run(main())
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert kept[-1].outputs[0].finish_reason == "length" and len(kept[-1].outputs[0].token_ids) == 6
