"""`glm5next serve` as users start it (here with MTP speculative decoding, a warm-up and an API key from the
environment): it shows loading progress, logs its warm-up, prints its address, enforces the key, logs each
request, serves its metrics, and stops cleanly on SIGTERM."""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import torch

from glm5next.server.cli import API_KEY_ENV, add_serve_parser, engine_args, exposure_warning, server_settings

KEY = "sk-cli-test"


def _get(url: str, headers: dict | None = None, data: bytes | None = None):
    req = urllib.request.Request(url, data=data, headers=headers or {}, method="POST" if data else "GET")
    return urllib.request.urlopen(req, timeout=60)


def test_serve_starts_answers_and_stops(tiny_dir):
    cmd = [sys.executable, "-m", "glm5next.cli", "serve", "--model", tiny_dir, "--port", "0", "--dtype", "float32",
           "--device", "cpu", "--max-model-len", "64", "--served-model-name", "tiny",
           "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}', "--warmup"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{API_KEY_ENV: KEY})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        m = re.search(r"http://[^/\s]+:(\d+)/v1", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
        base = f"http://127.0.0.1:{m.group(1)}"
        assert _get(base + "/health").status == 200
        body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0}).encode()
        with pytest.raises(urllib.error.HTTPError) as e:
            _get(base + "/v1/completions", {"Content-Type": "application/json"}, body)
        assert e.value.code == 401
        auth = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
        out = json.loads(_get(base + "/v1/completions", auth, body).read())
        assert out["usage"]["completion_tokens"] <= 3 and out["choices"][0]["finish_reason"] in ("stop", "length")
        metrics = _get(base + "/metrics").read().decode()
        assert "glm5next_spec_acceptance_rate" in metrics and 'acceptance_by_position{position="1"}' in metrics
        assert re.search(r"glm5next_generated_tokens_total [1-9]", metrics), metrics
        assert "# HELP glm5next_time_to_first_token_seconds" in metrics
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        log = proc.stderr.read()
        assert "loading weights" in log and "100%" in log  # the progress bar of the checkpoint's tensors
        assert re.search(r"INFO glm5next.runtime.engine_core: warm-up \(.*\) took [0-9.]+ s", log), log
        assert re.search(r'"POST /v1/completions HTTP/1.1" 401 .*\n.*"POST /v1/completions HTTP/1.1" 200', log), log
        assert "shutting down" in log and "stopped" in log
        assert "without an API key" not in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _args(*argv: str):
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", "--model", "DIR", *argv])


def test_serve_options(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    s = server_settings(_args("--allowed-hosts", "api.example, .internal", "--allowed-origins", "https://a.example"))
    assert s.api_key is None and s.allowed_hosts == ("api.example", ".internal")
    assert s.allowed_origins == ("https://a.example",) and s.model_name == "DIR"
    assert s.max_concurrent_requests == 4 * 64
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert server_settings(_args()).api_key == "from-env"
    assert server_settings(_args("--api-key", "given")).api_key == "given"
    with pytest.raises(ValueError, match="API key"):
        server_settings(_args("--api-key", "has space"))
    assert "without an API key" in exposure_warning("0.0.0.0", None)
    assert "without an API key" in exposure_warning("10.0.0.5", None)
    assert exposure_warning("0.0.0.0", "k") is None and exposure_warning("127.0.0.1", None) is None


def test_serve_takes_a_servers_step_budget():
    """`serve` builds a server's engine: 2048 tokens a step by default off a large GPU (8192 on one), as vLLM's
    API server; a given budget wins."""
    args = engine_args(_args())
    assert args.serving and args.max_num_batched_tokens is None
    assert args.step_budget(torch.device("cpu")) == 2048
    assert engine_args(_args("--max-num-batched-tokens", "4096")).step_budget(torch.device("cpu")) == 4096


def test_serve_warms_up_by_default_where_kernels_compile():
    """No option: the engine decides (on a GPU); `--warmup` and `--no-warmup` decide for it."""
    assert engine_args(_args()).warmup is None
    assert engine_args(_args("--warmup")).warmup is True
    assert engine_args(_args("--no-warmup")).warmup is False
