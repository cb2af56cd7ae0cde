"""``computron serve`` restarts a dead engine: kill -9 a worker of a running server; /health answers 503 while
the engine restarts, then 200; a greedy stream in flight is replayed on the new engine (checked against the
tokens it already sent) and ends with the same text as before; a new request answers the same greedy tokens.
"""
import json
import os
import signal
import time

import httpx
import pytest
from serve_helpers import ServerProcess, write_checkpoints

pytestmark = pytest.mark.timeout(600)
WAIT_S = 240.0
"""How long the test waits for each state (a restart on a loaded 2-core machine)."""


def _health_until(url, status):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        r = httpx.get(url + "/health", timeout=30)
        if r.status_code == status:
            return r.json()
        time.sleep(0.05)  # a bounded wait for the server's state to change
    raise AssertionError(f"/health never answered {status} within {WAIT_S}s")


def test_a_killed_worker_leads_to_a_restarted_engine_that_answers_again(tmp_path):
    ckpts = write_checkpoints(str(tmp_path / "ckpt"), n=1)
    srv = ServerProcess(str(tmp_path), {"m0": ckpts["m0"]}, server={"engine_restart_backoff_s": 0.5})
    try:
        c = httpx.Client(base_url=srv.url, timeout=WAIT_S)
        body = {"model": "m0", "prompt": "The engine swaps models", "max_tokens": 40, "temperature": 0}
        before = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        text = []
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    text.append(json.loads(line[6:])["choices"][0]["text"])
                    break
            os.kill(srv.engine_workers[0].pid, signal.SIGKILL)  # the engine dies mid-stream
            dead = _health_until(srv.url, 503)
            assert dead["status"] == "dead" and "the engine is restarting" in dead["reason"], dead
            for line in lines:
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    text.append(event["choices"][0]["text"])
        assert "".join(text) == before  # replayed on the new engine, the tokens already sent checked
        assert _health_until(srv.url, 200)["status"] == "ok"
        assert c.post("/v1/completions", json=body).json()["choices"][0]["text"] == before
        log = srv.log()
        assert "worker rank 0 exited unexpectedly (exit code -9)" in log, log
        assert ": restarting the engine in 0.5s (restart 1 of at most 3 within 600s)" in log, log
        assert "engine restarted (restart 1): serving again" in log
        m = httpx.get(srv.url + "/metrics", timeout=30).text
        assert "computron_engine_restarts_total 1.0" in m
        c.close()
    finally:
        srv.workers = srv.ps.children(recursive=True)  # the restarted engine's workers too
        rc, alive = srv.stop()
    assert rc == 0 and not alive, srv.log()
