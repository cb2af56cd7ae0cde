"""Starting `computron serve` as a subprocess for tests: checkpoints with tokenizers, a free port,
readiness by retrying /health within a deadline, and a stop that leaves no process behind."""
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import yaml

from computron import tokenizer_zoo
from computron.engine import EngineSnapshot, ModelSnapshot
from computron.engine.protocol import EngineClient
from helpers import free_port, is_multiprocessing_server, stop_command  # noqa: F401 - free_port: the server tests import it from here

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_checkpoints(root, n=3, no_chat=False):
    """``n`` tiny OPT checkpoints (seeds 0..n-1) with one locally trained tokenizer; ``nochat`` without
    a chat template when asked. Returns {model_id: path}."""
    tok = tokenizer_zoo.train_bpe(vocab_size=512)
    paths = {f"m{i}": tokenizer_zoo.save_checkpoint_with_tokenizer("opt-tiny", os.path.join(root, f"m{i}"),
                                                                    seed=i, tokenizer=tok) for i in range(n)}
    if no_chat:
        paths["nochat"] = tokenizer_zoo.save_checkpoint_with_tokenizer(
            "opt-tiny", os.path.join(root, "nochat"), seed=9, tokenizer=tok, chat_template=None)
    return paths


@contextlib.contextmanager
def app_in_thread(app):
    """Serve ``app`` with uvicorn from a thread of this process; yields its base URL.

    The socket listens before the thread starts, so a request sent at once waits in the backlog until
    uvicorn (after its start-up) accepts it: no readiness polling."""
    import uvicorn
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    t = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        t.join(30)
        sock.close()
    assert not t.is_alive(), "the in-thread server did not stop"


class StubEngineBase(EngineClient):
    """The server's view of the engine (``EngineClient``) in a given state (``error`` raised by requests,
    ``dead`` reason), for statuses a live engine cannot be put into on demand; one model, resident;
    subclasses answer ``submit`` / ``stream``."""

    def __init__(self, model_id: str):
        self.model_id = model_id
        self.error = None
        self.dead = None

    @property
    def is_alive(self):
        return self.dead is None

    @property
    def dead_reason(self):
        return self.dead

    def snapshot(self):
        model = ModelSnapshot(state="loaded", tier="device", waiting=0, running=0, paused=0, token_level=True,
                              pinned=False)
        return EngineSnapshot(alive=self.dead is None, dead_reason=self.dead, models={self.model_id: model})

    def counters(self):
        return {}

    def events(self, since=0):
        return since, []

    async def shutdown(self):
        pass


class ServerProcess:
    def __init__(self, tmp, models, engine=None, server=None, startup_timeout=180):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = {"models": [{"id": m, "path": p} if isinstance(p, str) else {"id": m, **p} for m, p in models.items()],
               "engine": {"tp": 1, "max_loaded": 1, **(engine or {})},
               "server": {"port": self.port, "log_level": "debug", **(server or {})}}
        self.config_path = os.path.join(tmp, f"serve-{self.port}.yaml")
        with open(self.config_path, "w") as f:
            yaml.safe_dump(cfg, f)
        self.log_path = os.path.join(tmp, f"serve-{self.port}.log")
        self._log = open(self.log_path, "w")
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen([sys.executable, "-m", "computron", "serve", "--config", self.config_path],
                                     cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.ps = psutil.Process(self.proc.pid)
        self.workers = []  # known once it is ready (a start-up that times out stops the server without them)
        self._wait_ready(startup_timeout)
        self.workers = self.ps.children(recursive=True)  # workers, multiprocessing's resource tracker and fork server
        self.engine_workers = [p for p in self.workers if not is_multiprocessing_server(p, self.proc.pid)]

    def _wait_ready(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)  # readiness retry within a bounded deadline
        self.stop()
        raise TimeoutError(f"server not ready within {timeout}s:\n{self.log()}")

    def log(self):
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self, timeout=60):
        """SIGTERM, then wait; kill whatever is left (the test fails on leftovers elsewhere)."""
        alive = stop_command(self.proc, self.workers, timeout, grace=15)
        self._log.close()
        return self.proc.returncode, alive
