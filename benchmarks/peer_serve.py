"""`computron serve` against `transformers serve` on the same three local checkpoints and requests.

Both servers get the same workload over HTTP (httpx, OpenAI's /v1/completions, greedy): first the requests
one at a time, round robin over the three models, then all of them at once. computron runs with
``--max-loaded`` (default 1: every model change is a swap; 3 keeps all resident, as the peer does);
``transformers serve`` loads a model on its first request and keeps it until ``--model-timeout`` seconds idle
(here: longer than the run), so it holds all three.
Greedy answers must be the same text on both (the same weights and tokenizers); the JSON line says how
many were.

``transformers serve`` on CPU needs the ``accelerate`` package (not a computron dependency): install it,
or point PYTHONPATH at a folder holding it (``pip install --target DIR accelerate``).

    python benchmarks/peer_serve.py [--model opt-tiny] [--n 30] [--max-tokens 16] [--tp 1] [--max-loaded 1]
"""
import argparse
import os
import sys
import asyncio
import json
import signal
import socket
import statistics
import subprocess
import tempfile
import time

import httpx

from computron import tokenizer_zoo

PROMPTS = ["The engine swaps models", "Hello wörld", "def submit(self, model_id", "GPU memory"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_on_sigterm() -> None:
    """End on SIGTERM (``timeout``, ``kill``) as on Ctrl-C: the caller's ``finally`` stops the servers it started
    (Python's default would leave them running)."""
    signal.signal(signal.SIGTERM, lambda sig, frame: sys.exit(128 + sig))


def start(cmd, url, log_path, env, timeout_s: float = 300):
    """Start a server in a session of its own (its workers stopped with it); return once /health answers."""
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # a server's readiness is only visible over HTTP: poll it
        if proc.poll() is not None:
            log.close()
            raise RuntimeError(f"{cmd[1:4]} exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, log
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop(proc, log)
    raise TimeoutError(f"{cmd[1:4]} not ready in {timeout_s} s; see {log_path}")


def stop(proc, log):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log.close()


async def workload(url, names, args):
    reqs = [(names[i % len(names)], PROMPTS[(i // len(names)) % len(PROMPTS)]) for i in range(args.n)]
    async with httpx.AsyncClient(base_url=url, timeout=600,
                                 limits=httpx.Limits(max_connections=args.n)) as c:
        async def one(model, prompt):
            t0 = time.perf_counter()
            r = await c.post("/v1/completions", json={"model": model, "prompt": prompt,
                                                      "max_tokens": args.max_tokens, "temperature": 0})
            r.raise_for_status()
            return time.perf_counter() - t0, r.json()["choices"][0]["text"]
        seq = [await one(m, p) for m, p in reqs]
        t0 = time.perf_counter()
        conc = await asyncio.gather(*[one(m, p) for m, p in reqs])
        wall = time.perf_counter() - t0
    lat = [s[0] * 1e3 for s in seq]
    ordered = sorted(lat[len(names):])  # after every model's first (cold) request
    return {"first_request_ms": round(lat[0], 1),
            "cold_ms_per_model": [round(x, 1) for x in lat[:len(names)]],
            "p50_ms": round(statistics.median(ordered), 2), "p99_ms": round(ordered[int(0.99 * (len(ordered) - 1))], 2),
            "mean_ms": round(statistics.fmean(ordered), 2),
            "concurrent_wall_s": round(wall, 3), "concurrent_req_per_s": round(args.n / wall, 2)}, \
        [s[1] for s in seq] + [c[1] for c in conc]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="opt-tiny", help="OPT shape of the three checkpoints (computron.zoo)")
    p.add_argument("--n", type=int, default=30, help="requests per phase (round robin over 3 models)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--max-loaded", type=int, default=1, help="computron's resident models (3: no swaps, as the peer)")
    p.add_argument("--ckpt-dir", default=os.path.join(tempfile.gettempdir(), "computron-peer-serve"))
    args = p.parse_args()
    exit_on_sigterm()
    tok = None
    paths = []
    for seed in range(3):
        path = os.path.join(args.ckpt_dir, f"{args.model}-{seed}")
        if not tokenizer_zoo.has_tokenizer(path) and tok is None:
            tok = tokenizer_zoo.train_bpe(vocab_size=512)
        paths.append(tokenizer_zoo.save_checkpoint_with_tokenizer(args.model, path, seed=seed, tokenizer=tok))
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    out = {"bench": "peer_serve", "model": args.model, "n": args.n, "max_tokens": args.max_tokens, "tp": args.tp,
           "max_loaded": args.max_loaded}

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    names = [f"m{i}={p}" for i, p in enumerate(paths)]
    proc, log = start([sys.executable, "-m", "computron", "serve", *names, "--tp", str(args.tp),
                       "--max-loaded", str(args.max_loaded),
                       "--port", str(port), "--log-level", "warning"], url,
                      os.path.join(args.ckpt_dir, "computron-serve.log"), env)
    try:
        out["computron"], ours = asyncio.run(workload(url, [f"m{i}" for i in range(3)], args))
        fams = httpx.get(url + "/metrics").text
        out["computron"]["loads"] = int(sum(float(line.rsplit(" ", 1)[1]) for line in fams.splitlines()
                                            if line.startswith("computron_swaps_total") and 'kind="load"' in line))
    finally:
        stop(proc, log)

    try:
        import importlib.util
        if importlib.util.find_spec("accelerate") is None and not any(
                os.path.isdir(os.path.join(d, "accelerate")) for d in os.environ.get("PYTHONPATH", "").split(":") if d):
            raise RuntimeError("transformers serve needs `accelerate` on CPU: pip install accelerate "
                               "(or PYTHONPATH=DIR after pip install --target DIR accelerate)")
        exe = os.path.join(os.path.dirname(sys.executable), "transformers")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc, log = start([exe, "serve", "--port", str(port), "--host", "127.0.0.1", "--device", "cpu",
                           "--model-timeout", "3600", "--log-level", "warning"], url,
                          os.path.join(args.ckpt_dir, "transformers-serve.log"), env)
        try:
            out["transformers_serve"], theirs = asyncio.run(workload(url, paths, args))
        finally:
            stop(proc, log)
        out["same_text"] = f"{sum(a == b for a, b in zip(ours, theirs))}/{len(ours)}"
    except RuntimeError as exc:
        out["transformers_serve"] = f"skipped: {exc}"
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
