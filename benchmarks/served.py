"""`computron serve` as a subprocess for the long-running server benchmarks (``swap_hygiene.py``,
``churn.py``): tiny checkpoints with one tokenizer, a YAML config, readiness within a deadline, the
process tree's figures (psutil), ``/metrics`` read as numbers, and a stop that reports what was left.

The server runs in a session of its own, so that a stop reaches every process it started.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional

import httpx
import psutil
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(name: str, *args) -> None:
    print(f"[{name} {time.strftime('%H:%M:%S')}]", *args, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_on_sigterm() -> None:
    """End on SIGTERM as on Ctrl-C, so that the caller's ``finally`` stops the server it started."""
    signal.signal(signal.SIGTERM, lambda sig, frame: sys.exit(128 + sig))


_WORDS = ("the engine swaps models def submit self model_id a of to in is and for on with request token answer "
          "server worker load offload memory device host cache prompt stream stop queue batch step rank shard "
          "layer weight adapter base version replace remove add serve client time byte file thread process").split()


def corpus(root: str) -> str:
    """A text file of seeded word salad to train the tokenizer on: the same file whatever the repository holds
    (the tokenizer zoo's default corpus is the package's own sources, which change with every commit), so that
    the checkpoints' greedy answers, which the benchmarks tell apart, stay the same."""
    import random
    path = os.path.join(root, "corpus.txt")
    if not os.path.isfile(path):
        rng = random.Random(0)
        lines = [" ".join(rng.choice(_WORDS) for _ in range(rng.randrange(4, 16))) + rng.choice(".,:;()=_")
                 for _ in range(4000)]
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(tmp, path)
    return path


def checkpoints(root: str, specs: Dict[str, tuple]) -> Dict[str, str]:
    """``{name: (zoo shape, seed)}`` -> ``{name: path}``: random-weight checkpoints under ``root`` (in folders
named by shape and seed) sharing one tokenizer trained on ``corpus``, kept when already there."""
    from computron import tokenizer_zoo
    tok = None
    paths = {}
    os.makedirs(root, exist_ok=True)
    for name, (shape, seed) in specs.items():
        path = os.path.join(root, f"{shape}-seed{seed}")
        if not tokenizer_zoo.has_tokenizer(path) and tok is None:
            tok = tokenizer_zoo.train_bpe([corpus(root)], vocab_size=512)
        paths[name] = tokenizer_zoo.save_checkpoint_with_tokenizer(shape, path, seed=seed, tokenizer=tok)
    return paths


def lora(base_path: str, root: str, seed: int) -> str:
    """A random PEFT LoRA adapter for the checkpoint ``base_path``, kept when already there."""
    from computron.testing.zoo_lora import save_random_lora
    out = os.path.join(root, f"lora-{os.path.basename(base_path)}-seed{seed}")
    if os.path.isfile(os.path.join(out, "adapter_config.json")):
        return out
    return save_random_lora(base_path, out, seed=seed)


class Server:
    """One ``computron serve --config`` subprocess (a session of its own), ready on return."""

    def __init__(self, workdir: str, models: List[dict], engine: dict, server: Optional[dict] = None,
                 startup_timeout_s: float = 300.0, env: Optional[dict] = None):
        os.makedirs(workdir, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {"models": models, "engine": engine,
                  "server": {"port": self.port, "log_level": "info", **(server or {})}}
        self.config_path = os.path.join(workdir, f"serve-{self.port}.yaml")
        with open(self.config_path, "w") as f:
            yaml.safe_dump(config, f)
        self.log_path = os.path.join(workdir, f"serve-{self.port}.log")
        self._log = open(self.log_path, "w")
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", **(env or {}))
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen([sys.executable, "-m", "computron", "serve", "--config", self.config_path],
                                     cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.ps = psutil.Process(self.proc.pid)
        self.family: List[psutil.Process] = []
        try:
            self._wait_ready(startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # readiness is only visible over HTTP: polled within a deadline
            if self.proc.poll() is not None:
                raise RuntimeError(f"computron serve exited with {self.proc.returncode} during start-up; see "
                                   f"{self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    self.family = self.tree()
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"computron serve not ready within {timeout_s}s; see {self.log_path}")

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]

    def tree(self) -> List[psutil.Process]:
        """The server's process and every process below it."""
        try:
            return [self.ps] + self.ps.children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def figures(self) -> Dict[str, int]:
        """The whole tree's resident memory (bytes; ``rss_by_pid`` each process's), open file descriptors,
        open regular files, threads, and the number of processes below the server."""
        out = {"rss_bytes": 0, "fds": 0, "open_files": 0, "threads": 0, "children": 0, "rss_by_pid": {}}
        for p in self.tree():
            try:
                with p.oneshot():
                    rss = p.memory_info().rss
                    out["rss_bytes"] += rss
                    out["rss_by_pid"][p.pid] = rss
                    out["fds"] += p.num_fds()
                    out["threads"] += p.num_threads()
                    out["open_files"] += len(p.open_files())
                out["children"] += p.pid != self.proc.pid
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
        return out

    def metrics(self, client: httpx.Client) -> Dict[str, float]:
        """``/metrics`` as ``{'name{label="v",...}': value}`` (every sample, labels sorted)."""
        from prometheus_client.parser import text_string_to_metric_families
        text = client.get(self.url + "/metrics", timeout=30).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out

    def stop(self, timeout_s: float = 60.0) -> List[int]:
        """SIGTERM the server and wait; kill what is left of its tree. Returns the pids that had to be killed
        (or were still there after the server exited)."""
        family = {p.pid: p for p in self.family + self.tree()}
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        others = [p for pid, p in family.items() if pid != self.proc.pid]
        _, alive = psutil.wait_procs(others, timeout=15)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self._log.close()
        return sorted(p.pid for p in alive)


def summed(metrics: Dict[str, float], name: str, **labels) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    total = 0.0
    for key, v in metrics.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{val}"' in rest for k, val in labels.items()):
            total += v
    return total
