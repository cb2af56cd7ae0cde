"""Churn through `computron serve`: 16 clients while models and adapters come and go, with no failed request.

Prints exactly one JSON line on stdout; progress goes to stderr.

One ``computron serve`` subprocess serves eight tiny random-weight checkpoints (four OPT, four Llama) as
``m0``..``m7``. First, each checkpoint's greedy answer to each prompt is taken alone (one request at a
time), and each of two LoRA adapters' on every OPT checkpoint: the references. Then, for ``--seconds``,
``--clients`` threads send completions at random ids (``m0``..``m7``, adapters ``a0``, ``a1``): whole or
streamed, ``n`` 1 or 2, some streams closed after their first chunk (cancelled), while one operator thread
changes what is served through the repository APIs at random: Triton's ``/v2/repository/models/{id}/load``
(an unserved id: added; a served one with another checkpoint: replaced) and ``/unload``, vLLM's
``/v1/load_lora_adapter`` on a served OPT base and ``/v1/unload_lora_adapter``, and an unload of a base
that has adapters, which must answer 409 and change nothing.

Invariants, checked on every request and change:

- a 200 answers the reference of a checkpoint (and adapter) its id named at some moment of the request
  (every choice alike); a stream ends with ``[DONE]`` and no error event; a cancelled stream's text so far
  is the start of such a reference;
- a refusal is a 404 for an id that was not served at some moment of the request, or a 429 / 503, each
  before any answer byte, with an error message; nothing else (no 5xx, no other 4xx);
- no request or change hangs (``--request-timeout``); every change answers 200 (409 for the base with
  adapters);
- at the end no model has a request waiting or running, everything unloads, and the server exits leaving
  no process.

The first failure stops the run; the JSON has ``pass``, the failures, the seed and the command that replays
the same changes and the same requests (thread timing aside). ``--seed`` fixes the operator's and every
client's choices.

    .venv/bin/python benchmarks/churn.py --seconds 300 --seed 1
    .venv/bin/python benchmarks/churn.py --quick --seed 7        # 30 s (the tests' path)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import httpx  # noqa: E402

from served import Server, checkpoints, exit_on_sigterm, log, lora, summed  # noqa: E402

CHECKPOINTS = {f"c{i}": ("opt-tiny" if i < 4 else "llama-tiny", 30 + i) for i in range(8)}
OPT = [c for c, (shape, _) in CHECKPOINTS.items() if shape == "opt-tiny"]
IDS = [f"m{i}" for i in range(8)]
ADAPTERS = ["a0", "a1"]
PROMPTS = ["The engine swaps models", "def submit(self, model_id", "GPU memory is", "a queue of requests", "x = 1;",
           "The worker loads its shard"]
"""Candidate prompts: the run uses the first ``USED_PROMPTS`` to which the eight checkpoints and the adapters on
the OPT ones all answer differently (tiny random models often loop on one token, and byte tokens that are no whole
character all read as U+FFFD), so that an answer of the wrong model or adapter cannot pass."""
USED_PROMPTS = 2
MAX_TOKENS = 6
MIN_SERVED = 3
Key = Tuple[str, Optional[str]]
"""What an id serves: (checkpoint, adapter or None)."""
Answer = Tuple[str, Tuple[str, ...]]
"""A choice's text and its tokens (``logprobs: 0``'s token strings: one per id, where texts of byte tokens that
are no whole character all read as U+FFFD)."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--max-loaded", type=int, default=2)
    p.add_argument("--request-timeout", type=float, default=120.0, help="a request or change taking longer hangs")
    p.add_argument("--dir", default=os.path.join(os.path.expanduser("~"), ".cache", "computron-bench", "churn-v2"))
    p.add_argument("--count-split-choices", action="store_true",
                   help="count, instead of failing on, an n > 1 answer whose choices came from two versions of a "
                        "model replaced meanwhile (the engine queues each choice on its own: a known bug)")
    p.add_argument("--quick", action="store_true", help="30 seconds")
    args = p.parse_args(argv)
    if args.quick:
        args.seconds = 30.0
    return args


class Failure(Exception):
    pass


@dataclass
class History:
    """What each id served when, on this process's clock. An interval starts when its change was sent and
    ends when the change that closed it answered."""
    served: Dict[str, List[list]] = field(default_factory=dict)
    """id -> [[key, start, end or None], ...]"""
    unserved: Dict[str, List[list]] = field(default_factory=dict)
    """id -> [[start, end or None], ...]"""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self, mid: str, key: Optional[Key], t: float) -> None:
        """A change of ``mid`` to ``key`` (None: unserved) was sent at ``t``."""
        with self.lock:
            if key is None:
                self.unserved.setdefault(mid, []).append([t, None])
            else:
                self.served.setdefault(mid, []).append([key, t, None])

    def end(self, mid: str, closes_served: bool, t: float) -> None:
        """The change answered at ``t``: it closed the last served interval (a replace or an unload) or the
        last unserved one (an add)."""
        with self.lock:
            rows = self.served[mid] if closes_served else self.unserved[mid]
            target = rows[-2] if closes_served and rows[-1][2] is None and len(rows) > 1 and \
                rows[-2][2] is None else rows[-1]
            target[-1] = t

    def candidates(self, mid: str, t0: float, t1: float) -> set:
        with self.lock:
            return {k for k, s, e in self.served.get(mid, []) if s <= t1 and (e is None or e >= t0)}

    def gap(self, mid: str, t0: float, t1: float) -> bool:
        with self.lock:
            return any(s <= t1 and (e is None or e >= t0) for s, e in self.unserved.get(mid, []))


@dataclass
class Run:
    args: argparse.Namespace
    server: Server
    paths: Dict[str, str]
    adapter_paths: Dict[str, str]
    refs: Dict[Tuple[Key, int], str]
    history: History = field(default_factory=History)
    stop: threading.Event = field(default_factory=threading.Event)
    failures: List[str] = field(default_factory=list)
    prompts: List[int] = field(default_factory=list)
    """The indices in ``PROMPTS`` the clients send."""
    requests: Counter = field(default_factory=Counter)
    ops: Counter = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    final: Optional[tuple] = None
    """What the operator left served: ({id: checkpoint or None}, {adapter: base id or None})."""

    def fail(self, what: str) -> None:
        with self.lock:
            self.failures.append(what)
        log("churn", f"FAILURE (seed {self.args.seed}): {what}")
        self.stop.set()

    def count(self, what: str) -> None:
        with self.lock:
            self.requests[what] += 1


# ---- references ----------------------------------------------------------------------------------------

def completion(client: httpx.Client, url: str, model: str, prompt: str, n: int = 1) -> httpx.Response:
    return client.post(url + "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                      "temperature": 0, "n": n, "logprobs": 0})


def answer_of(choice: dict) -> Answer:
    return choice["text"], tuple(choice["logprobs"]["tokens"])


def change(client: httpx.Client, url: str, op: str, mid: str, path: Optional[str] = None,
           base: Optional[str] = None) -> httpx.Response:
    if op == "load":
        body = {"parameters": {"config": json.dumps({"path": path})}}
        return client.post(f"{url}/v2/repository/models/{mid}/load", json=body)
    if op == "unload":
        return client.post(f"{url}/v2/repository/models/{mid}/unload", json={})
    if op == "lora_load":
        return client.post(url + "/v1/load_lora_adapter", json={"lora_name": mid, "lora_path": path, "base": base})
    return client.post(url + "/v1/unload_lora_adapter", json={"lora_name": mid})


def references(server: Server, paths: Dict[str, str], adapter_paths: Dict[str, str]) -> Dict[Tuple[Key, int], str]:
    """Each checkpoint's (and adapter's, on every OPT checkpoint) greedy answer to each prompt, asked alone."""
    refs = {}
    with httpx.Client(timeout=300) as client:
        def ask(mid: str, key: Key):
            for i, prompt in enumerate(PROMPTS):
                r = completion(client, server.url, mid, prompt)
                if r.status_code != 200:
                    raise RuntimeError(f"reference of {key} from {mid}: {r.status_code} {r.text[:300]}")
                refs[(key, i)] = answer_of(r.json()["choices"][0])
        for i, mid in enumerate(IDS):
            ask(mid, (f"c{i}", None))
        for i, mid in enumerate(IDS):
            c = f"c{i}"
            if c not in OPT:
                continue
            for a, path in adapter_paths.items():
                r = change(client, server.url, "lora_load", a, path, base=mid)
                if r.status_code != 200:
                    raise RuntimeError(f"loading adapter {a} on {mid}: {r.status_code} {r.text[:300]}")
                ask(a, (c, a))
                r = change(client, server.url, "lora_unload", a)
                if r.status_code != 200:
                    raise RuntimeError(f"unloading adapter {a}: {r.status_code} {r.text[:300]}")
    return refs


# ---- clients ---------------------------------------------------------------------------------------------

KINDS = ("plain", "plain_n2", "stream", "stream_n2", "cancel")


def read_stream(r: httpx.Response, n: int, cancel: bool) -> Tuple[List[Answer], bool, Optional[str]]:
    """The choices' answers, whether ``[DONE]`` came, and the first error event (None when there was none).
    With ``cancel``, stops after the first chunk that carries a token (the caller then closes the stream)."""
    texts, tokens = [""] * n, [[] for _ in range(n)]

    def answers():
        return [(t, tuple(k)) for t, k in zip(texts, tokens)]
    for line in r.iter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        if payload == "[DONE]":
            return answers(), True, None
        obj = json.loads(payload)
        if "error" in obj:
            return answers(), False, json.dumps(obj["error"])[:500]
        for ch in obj.get("choices", []):
            texts[ch["index"]] += ch.get("text") or ""
            tokens[ch["index"]] += (ch.get("logprobs") or {}).get("tokens") or []
        if cancel and any(tokens):
            return answers(), False, None
    return answers(), False, None


def client_loop(run: Run, k: int) -> None:
    rng = random.Random(run.args.seed * 1000 + k + 1)
    url = run.server.url
    with httpx.Client(timeout=run.args.request_timeout) as client:
        while not run.stop.is_set():
            mid = rng.choice(IDS + ADAPTERS)
            p = rng.choice(run.prompts)
            kind = rng.choice(KINDS)
            n = 2 if kind.endswith("n2") else 1
            stream = kind != "plain" and kind != "plain_n2"
            body = {"model": mid, "prompt": PROMPTS[p], "max_tokens": MAX_TOKENS, "temperature": 0, "n": n,
                    "stream": stream, "logprobs": 0}
            what = f"client {k}: {kind} {mid} prompt {p}"
            t0 = time.perf_counter()
            try:
                if stream:
                    with client.stream("POST", url + "/v1/completions", json=body) as r:
                        if r.status_code == 200:
                            texts, done, error = read_stream(r, n, kind == "cancel")
                        else:
                            r.read()
                else:
                    r = client.post(url + "/v1/completions", json=body)
                    if r.status_code == 200:
                        texts, done, error = [answer_of(c) for c in sorted(r.json()["choices"],
                                                                           key=lambda c: c["index"])], True, None
            except httpx.TimeoutException as exc:
                run.fail(f"{what}: no answer within {run.args.request_timeout}s (a hang): {exc!r}")
                return
            except httpx.HTTPError as exc:
                run.fail(f"{what}: transport error {exc!r}")
                return
            except (ValueError, KeyError, TypeError) as exc:  # a body that is not the completion's JSON
                run.fail(f"{what}: a malformed answer: {exc!r}")
                return
            t1 = time.perf_counter()
            try:
                check(run, mid, p, kind, r, t0, t1, *((texts, done, error) if r.status_code == 200 else ()))
            except Failure as exc:
                run.fail(f"{what}: {exc}")
                return


def check(run: Run, mid: str, p: int, kind: str, r: httpx.Response, t0: float, t1: float,
          texts: Optional[List[Answer]] = None, done: bool = False, error: Optional[str] = None) -> None:
    status = r.status_code
    if status != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            raise Failure(f"{status} without an error message: {r.text[:300]!r}") from None
        if status == 404:
            if not run.history.gap(mid, t0, t1):
                raise Failure(f"404 ({message}) though {mid} was served all along")
            run.count("refused_404")
        elif status in (429, 503):
            run.count(f"refused_{status}")
        else:
            raise Failure(f"{status}: {message}")
        return
    allowed = {run.refs[(key, p)] for key in run.history.candidates(mid, t0, t1)}
    if not allowed:
        raise Failure(f"answered {texts!r} though {mid} served nothing during the request")
    if error is not None:
        raise Failure(f"the stream ended with an error event after its first token: {error}")
    if kind == "cancel":
        if not any(any(ref[1][:len(t[1])] == t[1] for ref in allowed) for t in texts if t[1]):
            raise Failure(f"cancelled stream's text {texts!r} starts no answer of {mid} ({allowed!r})")
        run.count("cancelled")
        return
    if not done:
        raise Failure(f"the stream ended without [DONE]: {texts!r}")
    if len(set(texts)) > 1 and set(texts) <= allowed and run.args.count_split_choices:
        run.count("split_choices")  # every choice right, from two versions: see --count-split-choices
        return
    if len(set(texts)) != 1 or texts[0] not in allowed:
        raise Failure(f"answered {texts!r}; the answers of what {mid} served meanwhile: {sorted(allowed)!r}")
    run.count(f"ok_{kind}")


# ---- the operator ------------------------------------------------------------------------------------------

def operator_loop(run: Run) -> None:
    rng = random.Random(run.args.seed)
    url = run.server.url
    base: Dict[str, Optional[str]] = {m: f"c{i}" for i, m in enumerate(IDS)}
    on: Dict[str, Optional[str]] = {a: None for a in ADAPTERS}
    """adapter -> the base id it runs on"""
    with httpx.Client(timeout=run.args.request_timeout) as client:
        while not run.stop.is_set():
            served = [m for m in IDS if base[m] is not None]
            with_adapters = {b for b in on.values() if b is not None}
            free = [m for m in served if m not in with_adapters]
            choices = []
            if len(served) < len(IDS):
                choices.append("add")
            if free:
                choices += ["replace", "replace"]
                if len(served) > MIN_SERVED:
                    choices.append("remove")
            opt_bases = [m for m in served if base[m] in OPT]
            if opt_bases and any(b is None for b in on.values()):
                choices.append("lora_load")
            if with_adapters:
                choices += ["lora_unload", "remove_refused"]
            op = rng.choice(choices)
            t0 = time.perf_counter()
            try:
                if op == "add":
                    mid = rng.choice([m for m in IDS if base[m] is None])
                    c = rng.choice(sorted(CHECKPOINTS))
                    run.history.begin(mid, (c, None), t0)
                    expect(change(client, url, "load", mid, run.paths[c]), 200, op, mid, '"added"')
                    run.history.end(mid, False, time.perf_counter())
                    base[mid] = c
                elif op == "replace":
                    mid = rng.choice(free)
                    c = rng.choice([x for x in sorted(CHECKPOINTS) if x != base[mid]])
                    run.history.begin(mid, (c, None), t0)
                    expect(change(client, url, "load", mid, run.paths[c]), 200, op, mid, '"replaced"')
                    run.history.end(mid, True, time.perf_counter())
                    base[mid] = c
                elif op == "remove":
                    mid = rng.choice(free)
                    run.history.begin(mid, None, t0)
                    expect(change(client, url, "unload", mid), 200, op, mid)
                    run.history.end(mid, True, time.perf_counter())
                    base[mid] = None
                elif op == "remove_refused":
                    mid = rng.choice(sorted(with_adapters))
                    expect(change(client, url, "unload", mid), 409, op, mid, "adapters")
                elif op == "lora_load":
                    a = rng.choice([x for x in ADAPTERS if on[x] is None])
                    b = rng.choice(opt_bases)
                    run.history.begin(a, (base[b], a), t0)
                    expect(change(client, url, "lora_load", a, run.adapter_paths[a], base=b), 200, op, a)
                    run.history.end(a, False, time.perf_counter())
                    on[a] = b
                else:
                    a = rng.choice([x for x in ADAPTERS if on[x] is not None])
                    run.history.begin(a, None, t0)
                    expect(change(client, url, "lora_unload", a), 200, op, a)
                    run.history.end(a, True, time.perf_counter())
                    on[a] = None
            except httpx.TimeoutException as exc:
                run.fail(f"operator: {op} got no answer within {run.args.request_timeout}s (a hang): {exc!r}")
                return
            except (Failure, httpx.HTTPError, ValueError, KeyError) as exc:
                run.fail(f"operator: {exc!r}")
                return
            with run.lock:
                run.ops[op] += 1
            run.stop.wait(rng.uniform(0.0, 0.5))  # pacing: the clients get some requests in between changes
    run.final = (base, on)


def expect(r: httpx.Response, status: int, op: str, mid: str, needle: str = "") -> None:
    if r.status_code != status or needle not in r.text:
        raise Failure(f"{op} {mid}: expected {status}{f' with {needle}' if needle else ''}, got {r.status_code}: "
                      f"{r.text[:500]}")


# ---- the run -----------------------------------------------------------------------------------------------

def idle(server: Server, client: httpx.Client) -> Dict[str, float]:
    """The models with a request waiting or running, per /metrics (empty: idle)."""
    m = server.metrics(client)
    busy = {}
    for key, v in m.items():
        if (key.startswith("computron_queue_depth{") or key.startswith("computron_running_sequences{")) and v:
            busy[key] = v
    return busy


def teardown(run: Run, client: httpx.Client) -> None:
    """Unload every adapter, then every base: each answers 200 (nothing is left running under them)."""
    if run.final is None:
        return
    base, on = run.final
    for a, b in on.items():
        if b is not None:
            expect(change(client, run.server.url, "lora_unload", a), 200, "final lora_unload", a)
    for m, c in base.items():
        if c is not None:
            expect(change(client, run.server.url, "unload", m), 200, "final unload", m)


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    root = args.dir
    paths = checkpoints(root, CHECKPOINTS)
    adapter_paths = {a: lora(paths["c0"], root, seed=40 + i) for i, a in enumerate(ADAPTERS)}
    models = [{"id": m, "path": paths[f"c{i}"]} for i, m in enumerate(IDS)]
    server = Server(os.path.join(root, "runs"), models, {"tp": args.tp, "max_loaded": args.max_loaded})
    doc = {"benchmark": "churn", "seed": args.seed, "seconds": args.seconds, "clients": args.clients,
           "tp": args.tp, "max_loaded": args.max_loaded,
           "replay": f"python benchmarks/churn.py --seconds {args.seconds:g} --seed {args.seed} --clients "
                     f"{args.clients} --tp {args.tp} --max-loaded {args.max_loaded}"
                     + (" --count-split-choices" if args.count_split_choices else "")}
    run = None
    try:
        log("churn", f"server {server.url} ready; references ...")
        refs = references(server, paths, adapter_paths)
        prompts = []
        for i in range(len(PROMPTS)):
            answers = [v for (key, j), v in refs.items() if j == i]
            doc.setdefault("distinct_references", []).append(f"{len(set(answers))} of {len(answers)}")
            if len(set(answers)) == len(answers) and len(prompts) < USED_PROMPTS:
                prompts.append(i)
        if len(prompts) < USED_PROMPTS:
            raise RuntimeError(f"fewer than {USED_PROMPTS} prompts are answered differently by every checkpoint and "
                               f"adapter: {doc['distinct_references']}")
        doc["prompts"] = [PROMPTS[i] for i in prompts]
        run = Run(args, server, paths, adapter_paths, refs, prompts=prompts)
        for i, m in enumerate(IDS):
            run.history.begin(m, (f"c{i}", None), 0.0)
        for a in ADAPTERS:
            run.history.begin(a, None, 0.0)
        log("churn", f"seed {args.seed}: {args.clients} clients and the operator for {args.seconds:g}s")
        threads = [threading.Thread(target=client_loop, args=(run, k), daemon=True) for k in range(args.clients)]
        threads.append(threading.Thread(target=operator_loop, args=(run,), daemon=True))
        for t in threads:
            t.start()
        run.stop.wait(args.seconds)
        run.stop.set()
        for t in threads:
            t.join(args.request_timeout + 30)
        if any(t.is_alive() for t in threads):
            run.fail("a client or the operator did not finish (a hang)")
        with httpx.Client(timeout=args.request_timeout) as client:
            busy = idle(server, client)
            if busy:
                run.fail(f"requests still waiting or running once every client had its answer: {busy}")
            try:
                teardown(run, client)
            except (Failure, httpx.HTTPError) as exc:
                run.fail(f"teardown: {exc}")
            doc["swaps"] = int(summed(server.metrics(client), "computron_swaps_total", kind="load"))
    finally:
        leftover = server.stop()
        doc["server_exit"] = server.proc.returncode
        log_text = open(server.log_path, errors="replace").read()
    failures = list(run.failures) if run else ["the run did not start"]
    if leftover:
        failures.append(f"processes left after the server stopped: {leftover}")
    doc.update({"requests": dict(sorted(run.requests.items())) if run else {},
                "changes": dict(sorted(run.ops.items())) if run else {},
                "tracebacks_in_server_log": log_text.count("Traceback"),
                "leftover_processes": leftover, "failures": failures, "pass": not failures,
                "server_log": server.log_path, "wall_s": round(time.perf_counter() - t_start, 1)})
    if failures:
        log("churn", f"FAILED with seed {args.seed}; replay: {doc['replay']}")
    print(json.dumps(doc))
    return doc


if __name__ == "__main__":
    exit_on_sigterm()
    main()
