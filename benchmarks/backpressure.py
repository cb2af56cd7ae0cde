"""Back-pressure under a burst: how many requests a bounded queue admits, and how fast the rest are refused.

Starts ``computron serve`` (one tiny OPT checkpoint with a trained tokenizer, ``--queue-size``, a batch of
``--batch``) as a subprocess, opens ``--burst`` persistent connections with one httpx client (each used
once for ``GET /health`` first, so no refusal pays a TCP handshake), then sends ``--burst`` completions at
once, each on its own connection, each asking for ``--max-tokens`` tokens. Each request's latency is taken
from when its last byte was written to when its answer's headers were read (httpcore's trace events).
Refusals must be 429 with a ``Retry-After`` of whole seconds >= 1.

With ``--ttft-slo S`` the model also has a TTFT objective of S seconds and ``ttft_refusal_factor``
``--ttft-factor``: once the predicted time to first token (the queue ahead at the model's measured
per-request time, its prefill) exceeds the factor times S, requests are refused before the queue is full
(reason ``ttft_late`` in ``computron_rejections_total``). Before the burst, twice ``--batch`` requests run
together (at most ``--queue-size``), so the model's per-request time is measured. ``master_ms`` is the
refusals' time inside the server (``Server-Timing: admission;dur=...``, from the route's start to the
refusal), the master's own share.

Prints one JSON line: statuses, refusals' latency (p50, p95, max, ms) and their master time, Retry-After
values, the rejection counters of ``/metrics`` by reason, and ``health_ms``: the same burst of ``GET /health`` on the
same connections just before (what the machine, the client and the HTTP stack take for an answer that does
nothing). With ``--compare DIR`` (a checkout of another
version of computron, e.g. ``git archive <commit> | tar -x -C DIR``) the burst runs ``--repeats`` times
against each, alternating (the other version's server first, then this one's, ...), and the line holds both
sides' runs and the ratio of their median refusal latencies (this / other).

    .venv/bin/python benchmarks/backpressure.py                                   # 200 at queue_size 50
    .venv/bin/python benchmarks/backpressure.py --ttft-slo 0.1 --ttft-factor 2   # predicted-late refusals
    .venv/bin/python benchmarks/backpressure.py --compare /tmp/computron-base    # against an older version
    .venv/bin/python benchmarks/backpressure.py --quick                           # the tests' path
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import yaml

_HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(_HERE)
sys.path.insert(0, os.path.join(_HERE, "..", "experiments"))

from workload import machine_info  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--burst", type=int, default=200, help="requests sent at once")
    p.add_argument("--queue-size", type=int, default=50)
    p.add_argument("--batch", type=int, default=4, help="the model's max_batch_size")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ttft-slo", type=float, default=None, help="engine.ttft_slo_s (with --ttft-factor)")
    p.add_argument("--ttft-factor", type=float, default=2.0, help="engine.ttft_refusal_factor")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--compare", metavar="DIR", help="another checkout to run alternately with this one")
    p.add_argument("--repeats", type=int, default=2, help="runs per side with --compare")
    p.add_argument("--quick", action="store_true", help="a burst of 30 at queue_size 6, 8 tokens: the tests' path")
    args = p.parse_args(argv)
    if args.quick:
        args.burst, args.queue_size, args.max_tokens = 30, 6, 8
    return args


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else None


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp: str, args, code: str) -> subprocess.Popen:
    from computron import tokenizer_zoo
    path = tokenizer_zoo.save_checkpoint_with_tokenizer("opt-tiny", os.path.join(tmp, "m"), seed=0,
                                                        tokenizer=tokenizer_zoo.train_bpe(vocab_size=512))
    engine = {"tp": 1, "max_loaded": 1, "queue_size": args.queue_size, "max_batch_size": args.batch}
    if args.ttft_slo is not None:
        engine.update(ttft_slo_s=args.ttft_slo, ttft_refusal_factor=args.ttft_factor)
    cfg = {"models": [{"id": "m", "path": path}], "engine": engine,
           "server": {"port": args.port, "log_level": "warning"}}
    with open(os.path.join(tmp, "serve.yaml"), "w") as f:
        yaml.safe_dump(cfg, f)
    log = open(os.path.join(tmp, "serve.log"), "w")
    return subprocess.Popen([sys.executable, "-m", "computron", "serve", "--config", os.path.join(tmp, "serve.yaml")],
                            stdout=log, stderr=subprocess.STDOUT, cwd=code,
                            env=dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=code))


async def wait_ready(client: httpx.AsyncClient, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"computron serve exited with {proc.returncode} during start-up")
        try:
            if (await client.get("/health")).status_code == 200:
                return
        except httpx.TransportError:
            pass
        await asyncio.sleep(0.2)  # readiness retry within a deadline
    raise TimeoutError("computron serve not ready")


async def timed(client: httpx.AsyncClient, method: str, path: str, **kw):
    """``(response, seconds)`` from its last byte written to its answer's headers read (httpcore's trace)."""
    marks = {}

    async def trace(event, info):
        if event in ("http11.send_request_body.complete", "http11.receive_response_headers.complete"):
            marks[event] = time.perf_counter()

    r = await client.request(method, path, extensions={"trace": trace}, **kw)
    return r, marks["http11.receive_response_headers.complete"] - marks["http11.send_request_body.complete"]


async def one(client: httpx.AsyncClient, i: int, args) -> dict:
    body = {"model": "m", "prompt": f"request {i} of the burst says", "max_tokens": args.max_tokens,
            "ignore_eos": True}
    r, latency = await timed(client, "POST", "/v1/completions", json=body)
    timing = re.search(r"admission;dur=([0-9.]+)", r.headers.get("server-timing", ""))
    return {"status": r.status_code, "latency_s": latency, "retry_after": r.headers.get("retry-after"),
            "master_ms": float(timing.group(1)) if timing else None,
            "code": r.json().get("error", {}).get("code") if r.status_code != 200 else None}


def rejections(metrics_text: str) -> dict:
    out = {}
    for line in metrics_text.splitlines():
        m = re.match(r'computron_rejections_total\{model="m",reason="([a-z_]+)"\} ([0-9.e+]+)', line)
        if m:
            out[m.group(1)] = int(float(m.group(2)))
    return out


async def run(args, code: str = REPO) -> dict:
    limits = httpx.Limits(max_connections=args.burst, max_keepalive_connections=args.burst)
    with tempfile.TemporaryDirectory() as tmp:
        proc = start_server(tmp, args, code)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{args.port}", limits=limits,
                                         timeout=600) as client:
                await wait_ready(client, proc)
                warm = await asyncio.gather(*(client.post("/v1/completions", json={
                    "model": "m", "prompt": "warm", "max_tokens": args.max_tokens, "ignore_eos": True})
                    for _ in range(min(2 * args.batch, args.queue_size))))  # a busy period: the per-request time
                assert all(w.status_code == 200 for w in warm), [w.text for w in warm]
                await asyncio.gather(*(client.get("/health") for _ in range(args.burst)))  # the connections
                health = await asyncio.gather(*(timed(client, "GET", "/health") for _ in range(args.burst)))
                health_ms = [dt * 1e3 for _, dt in health]
                t0 = time.perf_counter()
                results = await asyncio.gather(*(one(client, i, args) for i in range(args.burst)))
                wall = time.perf_counter() - t0
                metrics = (await client.get("/metrics")).text
        finally:
            proc.terminate()
            proc.wait(60)
    refused = [r for r in results if r["status"] == 429]
    lat_ms = [r["latency_s"] * 1e3 for r in refused]
    master = [r["master_ms"] for r in refused if r["master_ms"] is not None]
    statuses = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    retry = sorted({int(r["retry_after"]) for r in refused if r["retry_after"] is not None})
    return {"benchmark": "backpressure", "burst": args.burst, "queue_size": args.queue_size, "batch": args.batch,
            "max_tokens": args.max_tokens, "ttft_slo_s": args.ttft_slo,
            "ttft_factor": args.ttft_factor if args.ttft_slo is not None else None, "statuses": statuses,
            "admitted": sum(r["status"] == 200 for r in results), "refused": len(refused),
            "refusals_without_retry_after": sum(r["retry_after"] is None for r in refused),
            "refusal_codes": sorted({r["code"] for r in refused}),
            "refusal_ms": {"p50": pct(lat_ms, 50), "p95": pct(lat_ms, 95), "max": max(lat_ms, default=None),
                           "mean": statistics.mean(lat_ms) if lat_ms else None},
            "health_ms": {"p50": pct(health_ms, 50), "p95": pct(health_ms, 95), "max": max(health_ms)},
            "refusal_master_ms": {"p50": pct(master, 50), "p95": pct(master, 95), "max": max(master, default=None)},
            "retry_after_s": {"min": min(retry, default=None), "max": max(retry, default=None)},
            "rejections": rejections(metrics), "wall_s": wall, "load_average": os.getloadavg()}


def compare(args) -> dict:
    """``--repeats`` bursts per side, alternating: the other checkout's server, then this one's."""
    sides = {"other": [], "this": []}
    for _ in range(args.repeats):
        for side, code in (("other", os.path.abspath(args.compare)), ("this", REPO)):
            args.port = free_port()
            sides[side].append(asyncio.run(run(args, code)))
            print(f"  {side}: {sides[side][-1]['refusal_ms']}", file=sys.stderr, flush=True)
    p50 = {s: statistics.median(r["refusal_ms"]["p50"] for r in rs) for s, rs in sides.items()}
    return {"benchmark": "backpressure_compare", "other": os.path.abspath(args.compare), "runs": sides,
            "refusal_p50_ms": p50, "refusal_p50_ratio": p50["this"] / p50["other"], "machine": machine_info()}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.compare:
        print(json.dumps(compare(args)), flush=True)
        return
    args.port = args.port or free_port()
    print(json.dumps({**asyncio.run(run(args)), "machine": machine_info()}), flush=True)


if __name__ == "__main__":
    main()
