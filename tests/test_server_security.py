"""Who may use the server and how much work one request may cause: the API key, the JSON content type,
the Host allow-list, CORS, bounded fields, the concurrency cap, and big inputs that must not stall the
event loop (the 20 MB prompt, the 150k-message chat)."""

import json
import threading
import time

import pytest

from glm5next.server.middleware import host_allowed, host_name
from glm5next.server.settings import is_loopback
from tests.server_util import MODEL, request, send_raw, serving, wait_idle

openai = pytest.importorskip("openai")

KEY = "sk-test-0123456789"
AUTH = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def secured(served_engine):
    with serving(served_engine, api_key=KEY, allowed_hosts=("api.example",),
                 allowed_origins=("https://app.example",)) as s:
        yield s


@pytest.fixture(scope="module")
def open_server(served_engine):
    with serving(served_engine) as s:
        yield s


# ------------------------------------------------------------------ who may call
def test_api_key_is_enforced_on_v1(secured):
    with openai.OpenAI(base_url=secured.url, api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError) as e:
            c.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    for headers in ({}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}, {"Authorization": "Bearer"}):
        status, got, body = request(secured.port, "GET", "/v1/models", headers=headers)
        assert status == 401 and got["www-authenticate"] == "Bearer", headers
        assert "Authorization: Bearer" in body["error"]["message"]
    with openai.OpenAI(base_url=secured.url, api_key=KEY, max_retries=0) as c:
        assert c.completions.create(model=MODEL, prompt="hi", max_tokens=1).usage.completion_tokens == 1
        assert [m.id for m in c.models.list().data] == [MODEL]
    assert request(secured.port, "GET", "/health", headers={})[0] == 200  # probes and scrapers need no key
    assert request(secured.port, "GET", "/metrics", headers={})[0] == 200


@pytest.mark.parametrize("kind", ["text/plain", "application/x-www-form-urlencoded", None])
def test_post_bodies_must_be_declared_json(secured, kind):
    """Browsers send `text/plain` and form posts across origins without asking the server first."""
    headers = {"Authorization": f"Bearer {KEY}", **({"Content-Type": kind} if kind else {})}
    status, _, body = request(secured.port, "POST", "/v1/completions", {"model": MODEL, "prompt": "hi"}, headers)
    assert status == 415 and "application/json" in body["error"]["message"]
    ok = {**AUTH, "Content-Type": "application/json; charset=utf-8"}
    assert request(secured.port, "POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}, ok)[0] == 200


@pytest.mark.parametrize("host, allowed", [
    ("evil.example", False), ("evil.example:8000", False), ("localhost.evil.example", False),
    ("localhost:8000", True), ("127.0.0.1:8000", True), ("[::1]:8000", True), ("10.1.2.3", True),
    ("app.localhost", True), ("api.example", True), ("API.EXAMPLE:443", True), ("api.example.", True),
])
def test_host_allow_list(secured, host, allowed):
    status, _, body = request(secured.port, "GET", "/health", headers={"Host": host})
    assert (status == 200) == allowed, (status, body)
    if not allowed:
        assert status == 400 and body["error"]["code"] == "host_not_allowed" and "--allowed-hosts" in body["error"]["message"]


def test_host_patterns():
    assert host_name("[::1]:80") == "::1" and host_name("Example.COM:8000") == "example.com"
    assert host_allowed("a.b.example", (".example",)) and host_allowed("a.example", ("*.example",))
    assert not host_allowed("example.evil", (".example",)) and host_allowed("anything", ("*",))
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1") and not is_loopback("example.com")


def test_cors_only_for_allowed_origins(secured, open_server):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    status, headers, _ = request(secured.port, "OPTIONS", "/v1/completions", headers=preflight)
    assert status == 200 and headers["access-control-allow-origin"] == "https://app.example"
    status, headers, _ = request(secured.port, "OPTIONS", "/v1/completions",
                                 headers={**preflight, "Origin": "https://evil.example"})
    assert status == 400 and "access-control-allow-origin" not in headers
    # CORS is off unless asked for: no preflight is granted, no response is readable by another origin
    status, headers, _ = request(open_server.port, "OPTIONS", "/v1/completions", headers=preflight)
    assert status == 405 and "access-control-allow-origin" not in headers
    status, headers, _ = request(open_server.port, "GET", "/v1/models", headers={"Origin": "https://app.example"})
    assert status == 200 and "access-control-allow-origin" not in headers


# ------------------------------------------------------------------ bounded work
@pytest.mark.parametrize("field, value, param", [
    ("stop", ["a"] * 10**6, "stop"),
    ("stop", ["a", "b", "c", "d", "e"], "stop"),
    ("stop", ["x" * 257], "stop"),
    ("stop", [""], "stop"),
    ("stop_token_ids", list(range(10**5)), "stop_token_ids"),
    ("stop_token_ids", [10**9], "stop_token_ids"),
    ("logit_bias", {"1": 5}, "logit_bias"),
    ("logit_bias", [1], "logit_bias"),
    ("logprobs", 21, "logprobs"),
], ids=["1e6-stops", "5-stops", "long-stop", "empty-stop", "1e5-stop-ids", "stop-id-range", "logit-bias",
        "logit-bias-type", "logprobs"])
def test_unbounded_fields_are_refused(open_server, field, value, param):
    start = time.monotonic()
    status, _, body = request(open_server.port, "POST", "/v1/completions",
                              {"model": MODEL, "prompt": "hi", "max_tokens": 1, field: value})
    assert status == 400 and body["error"]["param"] == param, body
    status, _, body = request(open_server.port, "POST", "/v1/chat/completions",
                              {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                               "top_logprobs": 21})
    assert status == 400 and body["error"]["param"] == "top_logprobs"
    assert time.monotonic() - start < 30


def test_four_stop_strings_are_fine(open_server):
    status, _, body = request(open_server.port, "POST", "/v1/completions",
                              {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stop": ["w", "x", "y", "z" * 256],
                               "stop_token_ids": [1, 2]})
    assert status == 200, body


def test_request_bodies_too_big_or_too_slow(served_engine):
    with serving(served_engine, max_body_bytes=1000, body_timeout_s=0.3) as s:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        big = json.dumps({"model": MODEL, "prompt": "x" * 2000}).encode()
        reply = send_raw(s.port, head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(big), big))
        assert reply.startswith(b"HTTP/1.1 413") and b"limit of 1000 bytes" in reply
        reply = send_raw(s.port, head + b"Content-Length: 100\r\n\r\n{\"model\":")  # and then nothing
        assert reply.startswith(b"HTTP/1.1 408") and b"within 0.3 s" in reply
        assert s.server.api.admitted == 0


def test_concurrency_cap_answers_503(served_engine):
    with serving(served_engine, max_concurrent_requests=2) as s:
        slow = {"model": MODEL, "prompt": "slow", "max_tokens": 30, "ignore_eos": True, "temperature": 0}
        results = []
        threads = [threading.Thread(target=lambda: results.append(request(s.port, "POST", "/v1/completions", slow)))
                   for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while s.server.api.admitted < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        with openai.OpenAI(base_url=s.url, api_key="x", max_retries=0) as c:
            with pytest.raises(openai.InternalServerError) as e:
                c.completions.create(model=MODEL, prompt="one too many", max_tokens=1)
        assert e.value.status_code == 503 and e.value.body["code"] == "server_overloaded"
        assert e.value.response.headers["retry-after"] == "1"
        for t in threads:
            t.join(60)
        assert [r[0] for r in results] == [200, 200]
        assert request(s.port, "POST", "/v1/completions", {**slow, "max_tokens": 1})[0] == 200
    assert wait_idle(served_engine)


# ------------------------------------------------------------------ the event loop stays free
def _health_delays_during(port: int, body: bytes, path: str) -> tuple[list[float], int]:
    """The response times of /health polled while `body` is posted to `path`, and that post's status."""
    answer = []
    poster = threading.Thread(target=lambda: answer.append(request(port, "POST", path, body)[0]))
    poster.start()
    delays = []
    while poster.is_alive() or not delays:
        start = time.monotonic()
        assert request(port, "GET", "/health")[0] == 200
        delays.append(time.monotonic() - start)
        time.sleep(0.01)
    poster.join()
    return delays, answer[0]


@pytest.mark.parametrize("what", ["20MB-prompt", "150k-messages"])
def test_big_inputs_do_not_stall_other_clients(open_server, what):
    if what == "20MB-prompt":
        body = json.dumps({"model": MODEL, "prompt": "x" * (20 << 20)}).encode()
        path = "/v1/completions"
    else:
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": ""}] * 150_000}).encode()
        path = "/v1/chat/completions"
    delays, status = _health_delays_during(open_server.port, body, path)
    print(f"\n{what}: /health answered {len(delays)} times, slowest {max(delays) * 1000:.0f} ms")
    assert status == 400  # too long for the context, refused by its length before anything is tokenized
    assert max(delays) < 0.5
