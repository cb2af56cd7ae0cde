"""`computron serve` given Hugging Face hub ids, offline, from a cache written in huggingface_hub's layout:
docs/models.md's example run as written (a command-line id), and a YAML config naming a revision and a GGUF
file of a repository. Every answer equals the greedy tokens of transformers loading the same snapshot (or
the GGUF file's conversion)."""
import json
import os
import re
import shlex
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from helpers import command_env, free_port, greedy_reference, stop_command, write_tiny_llama_gguf
from serve_helpers import ServerProcess
from transformers import AutoTokenizer

from computron.testing import hub_cache
from computron.testing import tokenizer_zoo as tz

pytestmark = pytest.mark.timeout(600)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MARKER = "<!-- run by tests/server/test_hub_ids.py::test_docs_block_serves_a_hub_id_offline -->"
N = 8


def reference_text(path: str, prompt: str, max_tokens: int = N) -> str:
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return tok.decode(greedy_reference(path, tok(prompt)["input_ids"], max_tokens).tolist(), skip_special_tokens=True)


def docs_blocks():
    """The bash blocks of docs/models.md under this test's marker, in order."""
    text = open(os.path.join(ROOT, "docs", "models.md")).read()
    return [m.group(1) for m in re.finditer(re.escape(MARKER) + r"\n```bash\n(.*?)```", text, re.S)]


def wait_healthy(proc, url: str, log_path: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{open(log_path).read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)  # readiness retry within a bounded deadline
    raise TimeoutError(f"server not ready within {timeout}s:\n{open(log_path).read()}")


def test_docs_block_serves_a_hub_id_offline(tmp_path):
    """docs/models.md's two blocks as a reader runs them (their /tmp/computron-hub in this test's directory,
    port 8000 a free one): the first writes the cache and serves `llama=demo-org/llama-tiny` from it with
    HF_HUB_OFFLINE=1, the second's curl answers the snapshot's greedy tokens."""
    setup, curl = docs_blocks()
    port = free_port()

    def local(line):
        return line.replace("/tmp/computron-hub", str(tmp_path / "computron-hub")).replace("8000", str(port))
    write_cache, serve = [local(line) for line in setup.strip().splitlines()]
    env = command_env(TOKENIZERS_PARALLELISM="false")
    for k in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_HOME"):
        env.pop(k, None)
    done = subprocess.run(["bash", "-c", write_cache], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    words = shlex.split(serve)
    assignments = [w for w in words if re.fullmatch(r"[A-Z_]+=\S*", w)]
    assert assignments == words[:2] and words[2:4] == ["computron", "serve"], words
    serve_env = dict(env, **dict(w.split("=", 1) for w in assignments))
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(words[2:], env=serve_env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    family = []
    try:
        wait_healthy(proc, f"http://127.0.0.1:{port}", str(log_path))
        family = psutil.Process(proc.pid).children(recursive=True)
        answer = subprocess.run(["bash", "-c", local(curl.strip())], env=env, capture_output=True, text=True,
                                timeout=300)
        assert answer.returncode == 0, answer.stderr
        body = json.loads(answer.stdout)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"]
    finally:
        alive = stop_command(proc, family, timeout=60, grace=15)
    assert proc.returncode == 0 and not alive, open(log_path).read()
    snapshot = hub_cache.repo_folder(str(tmp_path / "computron-hub" / "cache"), "demo-org/llama-tiny")
    (commit,) = os.listdir(os.path.join(snapshot, "snapshots"))
    assert [m["id"] for m in models] == ["llama"]
    assert body["choices"][0]["text"] == reference_text(os.path.join(snapshot, "snapshots", commit), "Hello")
    log = open(log_path).read()
    assert "demo-org/llama-tiny: looking in the Hugging Face cache" in log, log


@pytest.fixture(scope="module")
def yaml_server(tmp_path_factory):
    """A server from a YAML config whose models are `demo-org/tiny@v1` (a tag of the second of two commits)
    and `demo-org/tiny-GGUF:tiny.gguf`, offline; PP=2, one model resident at a time (they swap)."""
    root = tmp_path_factory.mktemp("hub-yaml")
    cache = str(root / "hf")
    tok = tz.train_bpe(vocab_size=512)
    snaps = {s: hub_cache.write_repo(cache, "demo-org/tiny", tz.save_checkpoint_with_tokenizer(
        "llama-tiny", str(root / f"seed{s}"), seed=s, tokenizer=tok), refs=(ref,)) for s, ref in ((0, "main"),
                                                                                              (1, "v1"))}
    (root / "gguf").mkdir()
    write_tiny_llama_gguf(root / "gguf" / "tiny.gguf")
    snaps["gguf"] = hub_cache.write_repo(cache, "demo-org/tiny-GGUF", str(root / "gguf"))
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": cache, "COMPUTRON_CACHE_DIR": str(root / "computron-cache")}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the server process inherits them (ServerProcess passes this environment on)
    try:
        srv = ServerProcess(str(root), {"rev": "demo-org/tiny@v1", "gg": "demo-org/tiny-GGUF:tiny.gguf"},
                            engine={"pp": 2, "max_loaded": 1}, startup_timeout=300)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    yield srv, snaps, root
    rc, left = srv.stop()
    assert not left and rc == 0, srv.log()


def complete(url: str, model: str, prompt: str) -> str:
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": N,
                                                  "temperature": 0}, timeout=240)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_yaml_revision_and_gguf_file_of_repositories(yaml_server):
    srv, snaps, root = yaml_server
    from computron.storage import gguf
    converted = os.path.join(root / "computron-cache", "gguf", os.path.basename(
        gguf.cache_dir(os.path.join(snaps["gguf"], "tiny.gguf"))))
    for _ in range(2):  # the models swap in and out between the requests
        assert complete(srv.url, "rev", "The engine swaps") == reference_text(snaps[1], "The engine swaps")
        assert complete(srv.url, "gg", "ABCD") == reference_text(converted, "ABCD")
    assert reference_text(snaps[1], "The engine swaps") != reference_text(snaps[0], "The engine swaps")
    log = srv.log()
    assert "demo-org/tiny@v1: looking in the Hugging Face cache" in log and os.path.isdir(converted), log


def test_an_id_not_in_the_cache_exits_2_before_any_worker(tmp_path):
    env = command_env(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "empty"))
    done = subprocess.run([sys.executable, "-m", "computron", "serve", "x=demo-org/missing", "--port", "0"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"computron serve: error: models[0].path: demo-org/missing: no such local path, and demo-org/missing is not "
        f"in the Hugging Face cache {tmp_path / 'empty'} (HF_HUB_OFFLINE is set: nothing is downloaded; fetch it "
        "into that cache where the network is (hf download demo-org/missing), or set HF_HUB_CACHE or HF_HOME to the "
        "cache that holds it)")
