"""The OpenAI-compatible server on the tiny model: the real `openai` client, raw-HTTP errors,
a concurrent streaming load, and clients that go away mid-request."""

import asyncio
import http.client
import json
import math
import socket
import threading
import time
from types import SimpleNamespace

import pytest

openai = pytest.importorskip("openai")

MODEL = "tiny"
MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def server(tiny_dir):
    from glm5next.runtime.async_engine import AsyncLLM
    from glm5next.server import start_server

    engine = AsyncLLM.from_args(model=tiny_dir, dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN,
                                max_num_seqs=64, seed=0)
    loop = asyncio.new_event_loop()
    srv = loop.run_until_complete(start_server(engine, MODEL, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, name="test-server", daemon=True)
    thread.start()

    async def stop():
        await srv.close()
        await engine.shutdown()

    yield SimpleNamespace(port=srv.port, url=f"http://127.0.0.1:{srv.port}/v1", engine=engine)
    asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url, api_key="x", max_retries=0) as c:
        yield c


def _raw(server, method, path, body=None, headers=None):
    """(status, parsed JSON body or raw bytes) of one request over a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        conn.request(method, path, body=data, headers=headers or {"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, raw
    finally:
        conn.close()


def _wait_idle(engine, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.num_unfinished() == 0:
            return True
        time.sleep(0.02)
    return False


def _assert_finite_logprobs(values):
    assert values and all(isinstance(v, float) and math.isfinite(v) and v <= 0 for v in values)


# ------------------------------------------------------------------ openai client
def test_models_list(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_completions_stream_matches_non_stream(client):
    kw = dict(model=MODEL, prompt="The quick brown fox", max_tokens=8, temperature=0, logprobs=2,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    choice = full.choices[0]
    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    assert choice.finish_reason == "length"
    assert full.usage.completion_tokens == 8
    assert full.usage.prompt_tokens == len("The quick brown fox")  # the tiny tokenizer is byte level
    assert full.usage.total_tokens == full.usage.prompt_tokens + 8
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    _assert_finite_logprobs(lp.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)  # tokens with equal text share a key
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8
    streamed_lps = [x for c in chunks if c.choices and c.choices[0].logprobs
                    for x in c.choices[0].logprobs.token_logprobs]
    assert streamed_lps == pytest.approx(lp.token_logprobs, abs=1e-4)


def test_completions_token_id_prompt(client):
    ids = list(b"Hello")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    by_text = client.completions.create(model=MODEL, prompt=["Hello"], max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == 5


def test_chat_completions(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    kw = dict(model=MODEL, messages=messages, max_completion_tokens=6, temperature=0,
              extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw, logprobs=True, top_logprobs=3)
    choice = full.choices[0]
    assert full.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and full.usage.completion_tokens == 6
    content = choice.logprobs.content
    assert len(content) == 6 and all(len(t.top_logprobs) == 3 for t in content)
    _assert_finite_logprobs([t.logprob for t in content])
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)


# ------------------------------------------------------------------ raw HTTP errors
def test_errors_then_normal_request(server):
    status, body = _raw(server, "POST", "/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["type"] == "not_found_error"
    status, body = _raw(server, "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1})
    assert status == 400 and body["error"]["param"] == "temperature" and "temperature" in body["error"]["message"]
    status, body = _raw(server, "POST", "/v1/completions", {"model": MODEL, "prompt": "x" * (MAX_MODEL_LEN + 10)})
    assert status == 400 and "max_model_len" in body["error"]["message"]
    status, body = _raw(server, "POST", "/v1/chat/completions", b'{"model": "tiny", "messages": [')
    assert status == 400 and "JSON" in body["error"]["message"]
    for bad in ({"model": MODEL}, {"model": MODEL, "prompt": "x", "n": 2},
                {"model": MODEL, "prompt": "x", "echo": True}, {"model": MODEL, "prompt": "x", "max_tokens": "5"},
                {"model": MODEL, "prompt": [True]}, {"model": MODEL, "prompt": "x", "stop": 5}):
        status, body = _raw(server, "POST", "/v1/completions", bad)
        assert status == 400 and body["error"]["type"] == "invalid_request_error", bad
    status, body = _raw(server, "POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"content": "hi"}]})
    assert status == 400 and body["error"]["param"] == "messages"
    status, body = _raw(server, "GET", "/v2/nothing")
    assert status == 404 and "error" in body
    status, _ = _raw(server, "GET", "/v1/completions")
    assert status == 405
    status, _ = _raw(server, "GET", "/health")
    assert status == 200
    status, body = _raw(server, "POST", "/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 3,
                                                            "temperature": 0, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 3


def _send_raw(port, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_malformed_http(server):
    assert _send_raw(server.port, b"GARBAGE\r\n\r\n").startswith(b"HTTP/1.1 400")
    assert _send_raw(server.port, b"GET /health HTTP/1.1\r\nbad header\r\n\r\n").startswith(b"HTTP/1.1 400")
    big = b"POST /v1/completions HTTP/1.1\r\nContent-Length: 999999999999\r\n\r\n"
    assert _send_raw(server.port, big).startswith(b"HTTP/1.1 413")
    chunked = b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    assert _send_raw(server.port, chunked).startswith(b"HTTP/1.1 411")
    # keep-alive: two requests on one connection, then the connection closes on request
    two = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /v1/models HTTP/1.1\r\nConnection: close\r\n\r\n"
    reply = _send_raw(server.port, two)
    assert reply.count(b"HTTP/1.1 200 OK") == 2 and b'"max_model_len"' in reply


# ------------------------------------------------------------------ load
def test_concurrent_streams_match_sequential(server, client):
    cases = [(f"Request {i}: {'abcdefgh'[i % 8] * (1 + i % 5)} tail", 4 + i % 5) for i in range(64)]
    extra = {"ignore_eos": True}

    async def one(aclient, prompt, max_tokens):
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                  stream=True, stream_options={"include_usage": True},
                                                  extra_body=extra)
        text, finish, usage = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            usage = chunk.usage or usage
        return text, finish, usage.completion_tokens

    async def bad(aclient):
        with pytest.raises(openai.BadRequestError):
            await aclient.completions.create(model=MODEL, prompt="x", temperature=-1)

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url, api_key="x", max_retries=0) as aclient:
            jobs = [one(aclient, p, n) for p, n in cases] + [bad(aclient) for _ in range(4)]
            return (await asyncio.gather(*jobs))[: len(cases)]

    results = asyncio.run(main())
    for (prompt, max_tokens), (text, finish, count) in zip(cases, results):
        assert finish == "length" and count == max_tokens, prompt
        alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                          extra_body=extra)
        assert text == alone.choices[0].text, prompt
    assert _wait_idle(server.engine)


# ------------------------------------------------------------------ disconnects
def _start_request(server, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return s


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts(server, client, stream):
    engine = server.engine
    assert _wait_idle(engine)
    before = engine.engine.stats["generated_tokens"]
    budget = MAX_MODEL_LEN - 8
    s = _start_request(server, {"model": MODEL, "prompt": "go away", "temperature": 0, "ignore_eos": True,
                                "max_tokens": budget, "stream": stream})
    if stream:
        assert s.recv(4096).startswith(b"HTTP/1.1 200")  # the head, then the stream is under way
    deadline = time.monotonic() + 10
    while engine.num_unfinished() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.num_unfinished() == 1
    s.close()
    assert _wait_idle(engine), "the engine still holds the request of a client that went away"
    assert engine.engine.stats["generated_tokens"] - before < budget
    done = client.completions.create(model=MODEL, prompt="still fine", max_tokens=2, temperature=0)
    assert done.choices[0].finish_reason in ("length", "stop")
