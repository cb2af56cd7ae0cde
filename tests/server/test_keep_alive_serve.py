"""keep_alive and ``computron ps`` through ``computron serve`` (tiny OPT checkpoints, two resident slots):
a request's ``keep_alive: 0`` offloads its model once it is answered, a model's own keep-alive shows in
``GET /api/ps`` with until when it is kept, a bad value answers 400 naming the field, and ``computron ps``
prints the table (and one line naming the URL when no server answers)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from serve_helpers import REPO, ServerProcess, free_port, write_checkpoints  # noqa: E402

KEY = "sk-keep"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ckpts = write_checkpoints(str(tmp_path_factory.mktemp("keep-ckpt")), n=2)
    models = {"m0": ckpts["m0"], "m1": {"path": ckpts["m1"], "keep_alive": "10m"}}
    srv = ServerProcess(str(tmp_path_factory.mktemp("keep")), models, engine={"max_loaded": 2},
                        server={"api_keys": [KEY]})
    yield srv
    rc, left = srv.stop()
    assert not left and rc == 0, srv.log()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


def rows(http):
    r = http.get("/api/ps")
    assert r.status_code == 200, r.text
    return {m["name"]: m for m in r.json()["models"]}


def until_state(http, model, state, timeout_s=60.0):
    """Poll /api/ps within a deadline: the offload follows the answer, on the server's own time."""
    deadline = time.monotonic() + timeout_s
    while True:
        row = rows(http)[model]
        if row["state"] == state:
            return row
        assert time.monotonic() < deadline, f"{model} still {row['state']}, expected {state}"
        time.sleep(0.05)  # bounded polling of another process's state


def complete(http, model, **extra):
    r = http.post("/v1/completions", json={"model": model, "prompt": "hello there", "max_tokens": 3, **extra})
    assert r.status_code == 200, r.text
    return r


def test_keep_alive_zero_offloads_the_model_once_its_request_is_answered(server, http):
    complete(http, "m0", keep_alive=0)
    row = until_state(http, "m0", "host")
    assert row["device_bytes"] == 0 and row["keep_alive"] == "0s" and row["last_used"] is not None
    assert row["expires_at"] is None
    complete(http, "m0")  # no keep_alive: the model's own (the engine's default: while memory allows)
    row = until_state(http, "m0", "resident")
    assert row["keep_alive"] == "forever" and row["expires_at"] is None and row["device_bytes"] > 0


def test_a_models_own_keep_alive_shows_until_when_it_is_kept(server, http):
    before = time.time()
    complete(http, "m1")
    row = until_state(http, "m1", "resident")
    assert row["keep_alive"] == "10m" and row["keep_alive_s"] == 600.0
    assert before + 600 - 5 <= row["expires_at"] <= time.time() + 600 + 5
    complete(http, "m1", keep_alive="-1")  # a request's keep_alive overrides the model's
    row = until_state(http, "m1", "resident")
    assert row["keep_alive"] == "forever" and row["expires_at"] is None


@pytest.mark.parametrize("value", ["5x", True, [1], "soon"])
def test_a_bad_keep_alive_answers_400_naming_the_field(server, http, value):
    r = http.post("/v1/chat/completions", json={"model": "m0", "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 2, "keep_alive": value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "keep_alive" and "must be a duration like '5m'" in err["message"]


def test_computron_ps_prints_the_table(server, http):
    complete(http, "m1")
    until_state(http, "m1", "resident")
    env = dict(os.environ, PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-m", "computron", "ps", "--port", str(server.port), "--api-key", KEY],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["NAME", "STATE", "HOST", "DEVICE", "LAST", "USED", "UNTIL"]
    by_name = {ln.split()[0]: ln for ln in lines[1:]}
    assert set(by_name) == {"m0", "m1"}
    assert by_name["m1"].split()[1] == "resident" and "from now" in by_name["m1"] and " ago" in by_name["m1"]
    no_key = subprocess.run([sys.executable, "-m", "computron", "ps", "--port", str(server.port)], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=60)
    assert no_key.returncode == 1 and "answered 401" in no_key.stderr
    port = free_port()
    gone = subprocess.run([sys.executable, "-m", "computron", "ps", "--port", str(port)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert gone.returncode == 1 and f"cannot reach a computron server at http://127.0.0.1:{port}" in gone.stderr
