"""`make demo`: three models behind one OpenAI-compatible server, swapped through one device slot.

1. writes three small random-weight OPT checkpoints, each with a byte-level BPE tokenizer trained here on
   text from this repository (nothing is downloaded);
2. starts `computron serve` on them (TP=2 workers, max_loaded=1: each model change is a swap);
3. asks each model through the official `openai` client (the last one streaming) and prints the answers;
4. prints the swaps from `/metrics` and stops the server with SIGTERM.

The weights are random, so the answers are gibberish: the point is the path text -> tokens -> engine ->
tokens -> text, with swaps in between.

    python examples/serve/demo.py [--tp 2] [--max-loaded 1] [--model opt-tiny] [--keep-serving]
"""
import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from computron import tokenizer_zoo

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODELS = ("alpha", "beta", "gamma")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"computron serve exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the server was not ready within {timeout}s")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--max-loaded", type=int, default=1)
    p.add_argument("--model", default="opt-tiny", help="OPT shape of the three checkpoints (see computron.zoo)")
    p.add_argument("--ckpt-dir", default=os.path.join(tempfile.gettempdir(), "computron-serve-demo"))
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--keep-serving", action="store_true", help="leave the server up until Ctrl-C (status page)")
    args = p.parse_args()

    print(f"writing {len(MODELS)} {args.model} checkpoints with locally trained tokenizers to {args.ckpt_dir}")
    tok = None
    paths = {}
    for seed, name in enumerate(MODELS):
        path = os.path.join(args.ckpt_dir, f"{args.model}-{name}")
        if not tokenizer_zoo.has_tokenizer(path) and tok is None:
            tok = tokenizer_zoo.train_bpe(vocab_size=512)
        paths[name] = tokenizer_zoo.save_checkpoint_with_tokenizer(args.model, path, seed=seed, tokenizer=tok)

    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "computron", "serve", *(f"{n}={p}" for n, p in paths.items()),
           "--tp", str(args.tp), "--pp", str(args.pp), "--max-loaded", str(args.max_loaded), "--port", str(port)]
    print("$ computron serve " + " ".join(cmd[4:]), flush=True)
    server = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    try:
        wait_ready(url, server)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        print("\n(random weights: the answers are gibberish, and byte tokens that form no valid UTF-8 "
              "print as U+FFFD)")
        print("models:", ", ".join(f"{m.id} ({m.state})" for m in client.models.list().data), flush=True)
        if args.tp > 1:
            print(f"(TP={args.tp} on this CPU: every layer's all-reduce crosses between worker processes through "
                  "gloo, so a token takes tens of milliseconds where TP=1 takes one or two; on GPUs TP divides "
                  "the work instead, and it is what lets every rank load its shard at once)")
        prompts = {"alpha": "The engine swaps models", "beta": "Hello wörld 🚀", "gamma": "Tell me a story"}
        for name in MODELS[:2]:
            t0 = time.perf_counter()
            r = client.completions.create(model=name, prompt=prompts[name], max_tokens=16, temperature=0)
            print(f"\n[{name}] completion ({(time.perf_counter() - t0) * 1e3:.0f} ms, "
                  f"{r.usage.prompt_tokens}+{r.usage.completion_tokens} tokens): {prompts[name]!r} -> "
                  f"{r.choices[0].text!r}", flush=True)
        t0 = time.perf_counter()
        print("\n[gamma] streamed chat: ", end="", flush=True)
        for chunk in client.chat.completions.create(model="gamma", stream=True, max_tokens=24, temperature=0,
                                                    messages=[{"role": "user", "content": prompts["gamma"]}]):
            print(chunk.choices[0].delta.content or "", end="", flush=True)
        print(f"  ({(time.perf_counter() - t0) * 1e3:.0f} ms)")
        r = client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "and you?"}],
                                           max_tokens=12, temperature=0.8, seed=7)
        print(f"\n[alpha] chat, sampled: {r.choices[0].message.content!r}")

        print("\nswaps, from /metrics:")
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
        swaps = {(s.labels["model"], s.labels["kind"]): s.value for s in fams["computron_swaps"].samples
                 if s.name.endswith("_total")}
        secs = {(s.labels["model"], s.labels["kind"]): s.value for s in fams["computron_swap_seconds"].samples
                if s.name.endswith("_total")}
        nbytes = {(s.labels["model"], s.labels["kind"]): s.value for s in fams["computron_swap_bytes"].samples
                  if s.name.endswith("_total")}
        print(f"  {'model':8} {'kind':8} {'count':>5} {'seconds':>9} {'MB':>8}")
        for key in sorted(swaps):
            print(f"  {key[0]:8} {key[1]:8} {int(swaps[key]):5d} {secs.get(key, 0):9.4f} "
                  f"{nbytes.get(key, 0) / 1e6:8.2f}")
        reqs = {}
        for s in fams["computron_requests"].samples:
            if s.name.endswith("_total"):
                key = (s.labels["model"], s.labels["outcome"])
                reqs[key] = reqs.get(key, 0) + s.value
        print("requests:", ", ".join(f"{m} {o}: {int(v)}" for (m, o), v in sorted(reqs.items())))
        print(f"\nstatus page: {url}/   curl: curl {url}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"alpha\", \"prompt\": \"Hello\", \"max_tokens\": 8}}'")
        if args.keep_serving:
            print("serving until Ctrl-C")
            server.wait()
        else:
            print("(the server stops now; `.venv/bin/python examples/serve/demo.py --keep-serving` leaves it up "
                  "for the status page and curl, until Ctrl-C)")
    except KeyboardInterrupt:
        pass
    finally:
        if server.poll() is None:
            print("\nstopping the server (SIGTERM)", flush=True)
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(120)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    print(f"server exited with code {server.returncode}")
    return server.returncode


if __name__ == "__main__":
    sys.exit(main())
