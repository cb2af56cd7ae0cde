"""What the HTTP front adds: the same requests in-process (``engine.submit`` / ``engine.stream`` with token
ids) and over HTTP (``/v1/completions`` with text, through httpx), non-streaming and streaming.

One engine, one uvicorn server on the same event loop, one client; requests go one at a time, alternating
in-process and HTTP so both see the same machine state. The added latency of request i is
``http_i - inproc_i`` (the pair's difference); it covers the socket round trip, HTTP parsing, JSON,
tokenization, detokenization and SSE framing. The client is a minimal keep-alive HTTP/1.1 client on asyncio
streams (``--client raw``, the default), so the figure is the server's; ``--client httpx`` measures with
httpx instead, whose own per-request cost (about 1 ms here) then counts too. Prints one JSON line.

    python benchmarks/http_overhead.py [--n 200] [--max-tokens 16] [--tp 1] [--client raw|httpx]
"""
import argparse
import os
import sys
import asyncio
import json
import statistics
import tempfile
import time

import httpx

from computron import EngineConfig, LaunchEngine, ModelConfig, tokenizer_zoo, zoo
from computron.server import create_app
from computron.server.config import ServerSettings
from computron.server.text import ModelText

TARGET_MS = 2.0


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RawClient:
    """One keep-alive HTTP/1.1 connection: POST a JSON body, read a Content-Length or chunked answer."""

    def __init__(self, port):
        self.port = port

    async def __aenter__(self):
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc):
        self.writer.close()
        await self.writer.wait_closed()

    async def post(self, path, body):
        data = json.dumps(body).encode()
        self.writer.write(b"POST %s HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
        status = await self.reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"HTTP answer {status!r}")
        length, chunked = None, False
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            k, _, v = line.decode().partition(":")
            if k.lower() == "content-length":
                length = int(v)
            elif k.lower() == "transfer-encoding" and "chunked" in v:
                chunked = True
        if not chunked:
            return await self.reader.readexactly(length)
        parts = []
        while True:
            size = int((await self.reader.readline()).strip(), 16)
            chunk = await self.reader.readexactly(size + 2)
            if size == 0:
                return b"".join(parts)
            parts.append(chunk[:-2])


async def run(args, path):
    import uvicorn
    engine = await asyncio.to_thread(LaunchEngine, EngineConfig(max_loaded=1),
                                     [ModelConfig("m", zoo.load_causal_lm, {"path": path})], args.tp, 1)
    text = ModelText("m", path)
    app = create_app(engine, {"m": text}, ServerSettings(), owns_engine=False)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                                           lifespan="on", loop="asyncio", http="h11", ws="none"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    prompt = "The engine swaps models in and out of the devices"
    ids = text.encode(prompt)
    data = {"input_ids": ids, "max_tokens": args.max_tokens, "temperature": 0.0}
    body = {"model": "m", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
    rows = {"inproc": [], "http": [], "s_inproc": [], "s_http": []}
    n_tokens = []
    try:
        client = RawClient(port) if args.client == "raw" else httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=120)
        async with client as c:
            async def inproc():
                return len(await engine.submit("m", data))

            async def http():
                if args.client == "raw":
                    return json.loads(await c.post("/v1/completions", body))["usage"]["completion_tokens"]
                r = await c.post("/v1/completions", json=body)
                r.raise_for_status()
                return r.json()["usage"]["completion_tokens"]

            async def s_inproc():
                n = 0
                async for _ in engine.stream("m", data):
                    n += 1
                return n

            async def s_http():
                n = 0
                if args.client == "raw":
                    raw = await c.post("/v1/completions", {**body, "stream": True})
                    return sum(1 for line in raw.split(b"\n") if line.startswith(b"data: {"))
                async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    r.raise_for_status()
                    async for line in r.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            n += 1
                return n

            fns = {"inproc": inproc, "http": http, "s_inproc": s_inproc, "s_http": s_http}
            for i in range(args.warmup + args.n):
                for name, fn in fns.items():
                    t0 = time.perf_counter()
                    n = await fn()
                    dt = time.perf_counter() - t0
                    if i >= args.warmup:
                        rows[name].append(dt * 1e3)
                        if name == "s_inproc":
                            n_tokens.append(n)
    finally:
        server.should_exit = True
        await serving
        await engine.shutdown()
    added = [h - p for h, p in zip(rows["http"], rows["inproc"])]
    s_added = [h - p for h, p in zip(rows["s_http"], rows["s_inproc"])]
    per_tok = [a / n for a, n in zip(s_added, n_tokens)]
    r3 = lambda x: round(x, 3)  # noqa: E731
    out = {"bench": "http", "client": args.client, "n": args.n, "tp": args.tp, "model": "opt-tiny",
           "max_tokens": args.max_tokens,
           "tokens_per_request": statistics.median(n_tokens),
           "inproc_ms_p50": r3(pct(rows["inproc"], 50)), "http_ms_p50": r3(pct(rows["http"], 50)),
           "added_ms_p50": r3(pct(added, 50)), "added_ms_p99": r3(pct(added, 99)),
           "stream_inproc_ms_p50": r3(pct(rows["s_inproc"], 50)), "stream_http_ms_p50": r3(pct(rows["s_http"], 50)),
           "stream_added_ms_p50": r3(pct(s_added, 50)), "stream_added_ms_p99": r3(pct(s_added, 99)),
           "stream_added_ms_per_token_p50": r3(pct(per_tok, 50)),
           "stream_added_ms_per_token_p99": r3(pct(per_tok, 99)),
           "target_added_ms_p50": TARGET_MS, "meets_target": pct(added, 50) <= TARGET_MS}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=200, help="measured requests per mode")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--client", choices=["raw", "httpx"], default="raw")
    p.add_argument("--ckpt-dir", default=os.path.join(tempfile.gettempdir(), "computron-bench-http"))
    args = p.parse_args()
    path = tokenizer_zoo.save_checkpoint_with_tokenizer("opt-tiny", os.path.join(args.ckpt_dir, "m"), seed=0)
    out = asyncio.run(run(args, path))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
