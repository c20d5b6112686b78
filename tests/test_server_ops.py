"""Running the server: Prometheus metrics, the access log, /health while the engine is dead, and a shutdown
that lets live streams finish or ends them with a final event."""

import http.client
import json
import logging
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from glm5next.runtime.async_engine import AsyncLLM
from tests.server_util import MODEL, request, serving, wait_idle

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(served_engine):
    with serving(served_engine) as s:
        yield s


def _families(port: int) -> dict:
    status, headers, body = request(port, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    text = body.decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, f in families.items():
        assert f"# HELP {name}" in text and f.documentation, name
    return families


def _value(families, name, sample=None, **labels) -> float:
    return next(s.value for s in families[name].samples
                if s.name == (sample or name) and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics(server):
    with openai.OpenAI(base_url=server.url, api_key="x", max_retries=0) as c:
        c.completions.create(model=MODEL, prompt="count me", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        list(c.completions.create(model=MODEL, prompt="and me", max_tokens=3, stream=True))
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model=MODEL, prompt="x", temperature=-1)
    request(server.port, "GET", "/no/such/path")
    f = _families(server.port)
    assert _value(f, "glm5next_http_requests", "glm5next_http_requests_total", route="/v1/completions",
                  status="200") >= 2
    assert _value(f, "glm5next_http_requests", "glm5next_http_requests_total", route="/v1/completions",
                  status="400") >= 1
    assert _value(f, "glm5next_http_requests", "glm5next_http_requests_total", route="other", status="404") >= 1
    for name in ("glm5next_time_to_first_token_seconds", "glm5next_e2e_request_latency_seconds",
                 "glm5next_inter_token_latency_seconds"):
        assert f[name].type == "histogram" and _value(f, name, name + "_count") >= 2, name
        assert _value(f, name, name + "_bucket", le="+Inf") == _value(f, name, name + "_count")
    assert _value(f, "glm5next_inter_token_latency_seconds", "glm5next_inter_token_latency_seconds_count") >= 4 + 2
    assert _value(f, "glm5next_requests_finished", "glm5next_requests_finished_total", reason="length") >= 2
    assert _value(f, "glm5next_generated_tokens", "glm5next_generated_tokens_total") >= 8
    for gauge in ("glm5next_requests_running", "glm5next_requests_waiting", "glm5next_cache_usage",
                  "glm5next_server_requests"):
        assert f[gauge].type == "gauge" and _value(f, gauge) >= 0, gauge
    assert 0 <= _value(f, "glm5next_cache_usage") <= 1


def test_access_log(server, caplog):
    caplog.set_level(logging.INFO, logger="glm5next.access")
    request(server.port, "POST", "/v1/completions", {"model": MODEL, "prompt": "log me", "max_tokens": 1})
    request(server.port, "GET", "/v1/models?x=1")
    deadline = time.monotonic() + 5
    while len(caplog.records) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    lines = [r.getMessage() for r in caplog.records if r.name == "glm5next.access"]
    assert any('"POST /v1/completions HTTP/1.1" 200' in line for line in lines), lines
    assert any('"GET /v1/models?x=1 HTTP/1.1" 200' in line for line in lines), lines
    assert all(line.startswith("127.0.0.1:") and line.endswith("s") for line in lines)


def test_health_fails_while_the_engine_is_dead(tiny_dir, monkeypatch):
    engine = AsyncLLM.from_args(model=tiny_dir, dtype="float32", device="cpu", max_model_len=64, max_num_seqs=4)

    def broken_step():
        raise RuntimeError("a step failed")

    monkeypatch.setattr(engine.engine, "step", broken_step)
    with serving(engine) as s:
        assert request(s.port, "GET", "/health")[0] == 200
        conn, resp = _open_stream(s.port, 4)  # the stream under way learns of it in its last event
        events = _events(resp)
        conn.close()
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_dead"
        assert "a step failed" in events[-2]["error"]["message"]
        status, _, body = request(s.port, "GET", "/health")
        assert status == 503 and body["error"]["code"] == "engine_dead"
        status, _, body = request(s.port, "POST", "/v1/completions", {"model": MODEL, "prompt": "hi"})
        assert status == 503 and body["error"]["code"] == "engine_dead"
        s.call(engine.shutdown())


def _open_stream(port: int, max_tokens: int):
    """A streamed completion under way: (connection, response), the response's head read."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": MODEL, "prompt": "keep going", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def _events(resp) -> list:
    """The stream's events (parsed JSON, or the string [DONE]) until it ends."""
    out = []
    for line in resp.read().decode().split("\n\n"):
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@pytest.mark.parametrize("grace, finishes", [(60.0, True), (0.0, False)], ids=["finishes", "ended"])
def test_shutdown_drains_live_streams(served_engine, grace, finishes):
    with serving(served_engine) as s:
        conn, resp = _open_stream(s.port, 40)
        deadline = time.monotonic() + 10
        while not s.server.api.live and time.monotonic() < deadline:
            time.sleep(0.005)
        closing = threading.Thread(target=s.call, args=(s.server.close(grace),))
        closing.start()
        while not s.server.api.draining:
            time.sleep(0.005)
        if finishes:  # while draining, new requests are refused
            status, _, body = request(s.port, "POST", "/v1/completions", {"model": MODEL, "prompt": "late"})
            assert status == 503 and body["error"]["code"] == "server_shutting_down"
            assert request(s.port, "GET", "/health")[0] == 503
        events = _events(resp)
        conn.close()
        closing.join(30)
        assert events[-1] == "[DONE]"
        last = events[-2]
        if finishes:
            assert last["choices"][0]["finish_reason"] == "length"
            assert sum(len(e["choices"][0]["text"]) for e in events[:-1]) > 0
        else:
            assert last["error"]["code"] == "server_shutting_down" and "shut down" in last["error"]["message"]
    assert wait_idle(served_engine)
