"""`glm5next serve` as users start it (here with MTP speculative decoding): it prints its address, answers,
serves its metrics, and stops cleanly on SIGTERM."""

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request


def test_serve_starts_answers_and_stops(tiny_dir):
    cmd = [sys.executable, "-m", "glm5next.cli", "serve", "--model", tiny_dir, "--port", "0", "--dtype", "float32",
           "--device", "cpu", "--max-model-len", "64", "--served-model-name", "tiny",
           "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}']
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        m = re.search(r"http://[^/\s]+:(\d+)/v1", line)
        assert m, (line, proc.stderr.read() if proc.poll() is not None else "")
        base = f"http://127.0.0.1:{m.group(1)}"
        assert urllib.request.urlopen(base + "/health", timeout=30).status == 200
        req = urllib.request.Request(base + "/v1/completions", method="POST", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 3,
                                                      "temperature": 0}).encode())
        body = json.loads(urllib.request.urlopen(req, timeout=60).read())
        assert body["usage"]["completion_tokens"] <= 3 and body["choices"][0]["finish_reason"] in ("stop", "length")
        metrics = urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()
        assert "glm5next_spec_acceptance_rate" in metrics and 'acceptance_by_position{position="1"}' in metrics
        assert re.search(r"glm5next_generated_tokens_total [1-9]", metrics), metrics
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
