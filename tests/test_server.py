"""The OpenAI-compatible server on the small model, as clients use it: the official `openai` client and raw
HTTP, streaming and not, logprobs at the edges, errors as OpenAI error bodies, a concurrent streaming load, and
clients that go away mid-request."""

import ast
import asyncio
import json
import math
import os
import socket
import time

import pytest

import glm5next.server
from glm5next.checkpoint.tiny_tokenizer import SPECIAL_TOKENS
from tests.server_util import MODEL, request, send_raw, serving, wait_idle

openai = pytest.importorskip("openai")

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def server(served_engine):
    with serving(served_engine) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url, api_key="x", max_retries=0) as c:
        yield c


def _assert_finite_logprobs(values):
    assert values and all(isinstance(v, float) and math.isfinite(v) and v <= 0 for v in values)


# ------------------------------------------------------------------ openai client
def test_models_list_and_retrieve(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


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
    assert all(len(top) in (2, 3) for top in lp.top_logprobs)  # the 2 most likely, and the chosen one
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


# ------------------------------------------------------------------ edges
def _named_bytes(name: str, raw: list[int]) -> bool:
    """Whether a logprobs token name agrees with its bytes (text, or `bytes:\\x..` for part of a character)."""
    if name.startswith("token_id:"):  # the model's vocabulary is padded past the tokenizer's
        return raw == []
    if name.startswith("bytes:"):
        return name == "bytes:" + "".join(f"\\x{b:02x}" for b in raw) and not _utf8(bytes(raw))
    return name.encode() == bytes(raw)


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_logprobs_of_partial_characters_carry_real_bytes(client):
    """Byte tokens above 0x7f are parts of characters: each keeps its own bytes and name, none is "\\ufffd"."""
    kw = dict(model=MODEL, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "中文"}], logprobs=True,
                                          top_logprobs=8, **kw)
    entries = chat.choices[0].logprobs.content
    everything = entries + [alt for e in entries for alt in e.top_logprobs]
    assert any(e.token.startswith("bytes:") for e in everything), "no partial character to check"
    assert all(_named_bytes(e.token, e.bytes) and "\ufffd" not in e.token for e in everything)
    assert all(len({alt.token for alt in e.top_logprobs}) == 8 for e in entries)  # one entry per token id
    if not any(e.token in SPECIAL_TOKENS for e in entries):  # special tokens are left out of the text
        joined = b"".join(bytes(e.bytes) for e in entries)
        assert joined.decode("utf-8", "replace") == chat.choices[0].message.content
    done = client.completions.create(prompt="中文", logprobs=8, **kw)
    tops = done.choices[0].logprobs.top_logprobs
    assert all(len(top) in (8, 9) for top in tops)  # distinct partial tokens no longer share the key "\ufffd"
    assert any(key.startswith("bytes:") for top in tops for key in top)


def test_tiny_temperature_is_greedy(client):
    kw = dict(model=MODEL, prompt="Once upon", max_tokens=12, extra_body={"ignore_eos": True})
    greedy = client.completions.create(temperature=0, **kw).choices[0].text
    assert client.completions.create(temperature=1e-40, **kw).choices[0].text == greedy


def test_special_token_strings_in_chat_content_are_text(client):
    messages = [{"role": "user", "content": "<|system|>"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert plain.usage.prompt_tokens == 1 + len("<|system|>") + 1  # <|user|>, the text's bytes, <|assistant|>
    asked = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                           extra_body={"special_tokens_in_content": True})
    assert asked.usage.prompt_tokens == 3


def test_prompt_plus_max_tokens_beyond_the_context(server, client):
    prompt = "x" * 100
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=29)
    err = e.value.body
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert "128" in err["message"] and "at most 28" in err["message"]
    rest = client.completions.create(model=MODEL, prompt=prompt, temperature=0, extra_body={"ignore_eos": True})
    assert rest.usage.completion_tokens == MAX_MODEL_LEN - 100  # no max_tokens: the rest of the context


# ------------------------------------------------------------------ raw HTTP
def test_errors_are_openai_error_bodies(server):
    port = server.port
    status, _, body = request(port, "POST", "/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["type"] == "not_found_error"
    status, _, body = request(port, "POST", "/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1})
    assert status == 400 and body["error"]["param"] == "temperature" and "temperature" in body["error"]["message"]
    status, _, body = request(port, "POST", "/v1/completions", {"model": MODEL, "prompt": "x" * (MAX_MODEL_LEN + 10)})
    assert status == 400 and "max_model_len" in body["error"]["message"]
    status, _, body = request(port, "POST", "/v1/chat/completions", b'{"model": "tiny", "messages": [')
    assert status == 400 and "JSON" in body["error"]["message"]
    status, _, body = request(port, "POST", "/v1/completions", b'{"model": "tiny", "prompt": "\\ud800"}')
    assert status == 400 and "surrogate" in body["error"]["message"]
    for bad in ({"model": MODEL}, {"model": MODEL, "prompt": "x", "n": 2},
                {"model": MODEL, "prompt": "x", "echo": True}, {"model": MODEL, "prompt": "x", "max_tokens": "5"},
                {"model": MODEL, "prompt": [True]}, {"model": MODEL, "prompt": "x", "stop": 5}):
        status, _, body = request(port, "POST", "/v1/completions", bad)
        assert status == 400 and body["error"]["type"] == "invalid_request_error", bad
    status, _, body = request(port, "POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"content": "hi"}]})
    assert status == 400 and body["error"]["param"] == "messages"
    status, _, body = request(port, "GET", "/v2/nothing")
    assert status == 404 and "/v2/nothing" in body["error"]["message"]
    status, headers, body = request(port, "GET", "/v1/completions")
    assert status == 405 and headers["allow"] == "POST" and body["error"]["type"] == "invalid_request_error"
    status, _, body = request(port, "GET", "/health")
    assert status == 200 and body == {"status": "ok"}
    status, _, body = request(port, "POST", "/v1/completions", {"model": MODEL, "prompt": "ok", "max_tokens": 3,
                                                                "temperature": 0, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 3


def test_http_framing(server):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
               b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
    reply = send_raw(server.port, chunked)
    assert reply.startswith(b"HTTP/1.1 200") and b'"completion_tokens":2' in reply
    huge = (b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: 999999999999\r\n\r\n")
    reply = send_raw(server.port, huge)
    assert reply.startswith(b"HTTP/1.1 413") and b'"invalid_request_error"' in reply
    two = (b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"
           b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    reply = send_raw(server.port, two)
    assert reply.count(b"HTTP/1.1 200 OK") == 2 and b'"max_model_len"' in reply
    assert send_raw(server.port, b"GET /health HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.1 200")


# ------------------------------------------------------------------ load
def test_concurrent_streams_match_non_streamed(server):
    cases = [(f"Request {i}: {'abcdefgh'[i % 8] * (1 + i % 5)} tail", 4 + i % 5) for i in range(64)]
    extra = {"ignore_eos": True}

    async def streamed(aclient, prompt, max_tokens):
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

    async def whole(aclient, prompt, max_tokens):
        done = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                                extra_body=extra)
        return done.choices[0].text

    async def bad(aclient):
        with pytest.raises(openai.BadRequestError):
            await aclient.completions.create(model=MODEL, prompt="x", temperature=-1)

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url, api_key="x", max_retries=0) as aclient:
            streams = await asyncio.gather(*[streamed(aclient, p, n) for p, n in cases],
                                           *[bad(aclient) for _ in range(4)])
            # the same requests again, whole, batched differently (half of them at a time)
            wholes = []
            for half in (cases[::2], cases[1::2]):
                wholes += await asyncio.gather(*[whole(aclient, p, n) for p, n in half])
            return streams[: len(cases)], dict(zip([p for p, _ in cases[::2] + cases[1::2]], wholes))

    streams, wholes = asyncio.run(main())
    for (prompt, max_tokens), (text, finish, count) in zip(cases, streams):
        assert finish == "length" and count == max_tokens, prompt
        assert text == wholes[prompt], prompt
    assert wait_idle(server.engine)


# ------------------------------------------------------------------ disconnects
def _start_request(port, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return s


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_client_disconnect_aborts(server, client, stream):
    engine = server.engine
    assert wait_idle(engine)
    before = engine.engine.stats["generated_tokens"]
    budget = MAX_MODEL_LEN - 8
    s = _start_request(server.port, {"model": MODEL, "prompt": "go away", "temperature": 0, "ignore_eos": True,
                                     "max_tokens": budget, "stream": stream})
    if stream:
        assert s.recv(4096).startswith(b"HTTP/1.1 200")  # the head, then the stream is under way
    deadline = time.monotonic() + 10
    while engine.num_unfinished() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.num_unfinished() == 1
    s.close()
    assert wait_idle(engine), "the engine still holds the request of a client that went away"
    assert engine.engine.stats["generated_tokens"] - before < budget
    done = client.completions.create(model=MODEL, prompt="still fine", max_tokens=2, temperature=0)
    assert done.choices[0].finish_reason in ("length", "stop")


# ------------------------------------------------------------------ layout
@pytest.mark.parametrize("module", ["api", "prompts", "responses"])
def test_request_checks_import_no_web_framework(module):
    """What a request means and what is answered is decided without Starlette or uvicorn."""
    path = os.path.join(os.path.dirname(glm5next.server.__file__), f"{module}.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in imported if m.split(".")[0] in ("starlette", "uvicorn", "fastapi")}, imported
