"""`computron serve` end to end: a live server on localhost, the official `openai` client and httpx.

One server (three tiny OPT models with locally trained tokenizers, max_loaded=1, an API key) is shared by
most tests; the lifecycle tests (SIGTERM drain, engine death, timeouts) start their own. Answers are checked
against the unsharded transformers model's greedy tokens, detokenized.
"""
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import httpx
import openai
import psutil
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import REPO, ServerProcess, StubEngineBase, app_in_thread, write_checkpoints
from transformers import AutoTokenizer

from computron import zoo
from computron.errors import EngineDeadError, QueueFullError, RequestTimeoutError
from computron.server import create_app
from computron.server.config import ServerSettings
from computron.server.text import IncrementalDetokenizer, ModelText, TextStream

pytestmark = pytest.mark.timeout(300)

KEY = "sk-test"
MODELS = ("m0", "m1", "m2")
LONG = [2, 100, 200, 300]  # prompt ids whose greedy answers (seeds 0 and 1) run 1900 tokens without an EOS
PROMPTS = ["The engine swaps models", "Hello wörld 🚀", "def submit(self, model_id", "GPU memory", "x"]


@pytest.fixture(scope="session")  # data only: the tests that start their own servers need not share a worker
def ckpts(tmp_path_factory):
    return write_checkpoints(str(tmp_path_factory.mktemp("serve-ckpt")), n=3, no_chat=True)


@pytest.fixture(scope="module")
def server(ckpts, tmp_path_factory):
    models = {**ckpts, "q": {"path": ckpts["m0"], "queue_size": 1, "max_batch_size": 1}}  # for 429
    srv = ServerProcess(str(tmp_path_factory.mktemp("serve")), models, engine={"max_loaded": 1},
                        server={"api_keys": [KEY]})
    yield srv
    rc, left = srv.stop()
    assert not left and rc == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


class Reference:
    """Greedy answers of the unsharded transformers model, as token ids and as text."""

    def __init__(self, ckpts):
        self.ckpts = ckpts
        self.models, self.toks, self.cache = {}, {}, {}

    def tok(self, m):
        if m not in self.toks:
            self.toks[m] = AutoTokenizer.from_pretrained(self.ckpts[m], local_files_only=True)
        return self.toks[m]

    def ids(self, m, prompt_ids, n):
        key = (m, tuple(prompt_ids), n)
        if key not in self.cache:
            if m not in self.models:
                self.models[m] = zoo.load_causal_lm(self.ckpts[m])
            self.cache[key] = zoo.reference_generate(self.models[m], prompt_ids, n).tolist()
        return self.cache[key]

    def completion(self, m, prompt, n):
        p = self.tok(m)(prompt)["input_ids"]
        out = self.ids(m, p, n)
        return self.tok(m).decode(out, skip_special_tokens=True), len(p), len(out), out

    def chat(self, m, messages, n):
        text = self.tok(m).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        p = self.tok(m)(text, add_special_tokens=False)["input_ids"]
        out = self.ids(m, p, n)
        return self.tok(m).decode(out, skip_special_tokens=True), len(p), len(out), out


@pytest.fixture(scope="module")
def ref(ckpts):
    return Reference(ckpts)


def _reason(out_ids, n):
    return "stop" if out_ids and out_ids[-1] == 2 else "length"


def sse_events(lines):
    """Parsed `data:` payloads of a server-sent-events body, up to [DONE] (kept as the string)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def metrics(url):
    return parse_metrics(httpx.get(url + "/metrics", timeout=30).text)


def parse_metrics(text):
    """Prometheus text as {(name, sorted label items): value}."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def metric(samples, name, **labels):
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


# ---- text: incremental detokenization and stop strings (no server) ----------------

def test_incremental_detokenizer_matches_full_decode(ckpts):
    text = ModelText("m0", ckpts["m0"])
    gen = torch.Generator().manual_seed(0)
    for trial in range(200):  # random ids: partial UTF-8 sequences, special tokens, merges
        ids = torch.randint(0, 512, (int(torch.randint(1, 40, (1,), generator=gen)),), generator=gen).tolist()
        d = IncrementalDetokenizer(text, prompt_ids=[2, 50, 60])
        pieces = [d.add(t) for t in ids] + [d.finish()]
        assert "".join(pieces) == text.decode(ids), (trial, ids)
    s = "héllo wörld 🚀 façade — 日本語 naïve"
    ids = text.encode(s, add_special_tokens=False)
    assert len(ids) > len(s.split())  # multi-byte characters span several byte-level tokens
    d = IncrementalDetokenizer(text)
    pieces = [d.add(t) for t in ids]
    assert "\ufffd" not in "".join(pieces) and "".join(pieces) + d.finish() == s
    assert all("\ufffd" not in p for p in pieces)


def test_text_stream_stop_strings_hold_back_and_cut(ckpts):
    text = ModelText("m0", ckpts["m0"])
    s = "alpha beta gamma delta"
    ids = text.encode(s, add_special_tokens=False)
    for stop, expected in ((["gamma"], "alpha beta "), (["a d", "zzz"], "alpha beta gamm"), (["nope"], s)):
        ts = TextStream(text, stop=stop)
        sent = ""
        for t in ids:
            sent += ts.push(t)
            assert not any(x in sent for x in stop)  # a stop string is never sent, even in part
            if ts.stopped:
                break
        sent += ts.finish()
        assert sent == expected == ts.text and ts.stopped == (expected != s)


# ---- the shared server ---------------------------------------------------------------

def test_completions_three_models_stream_equals_nonstream_and_reference(client, ref):
    for rnd in range(2):  # round robin over three models with max_loaded=1: every request swaps
        for m in MODELS:
            prompt = PROMPTS[rnd]
            want, n_prompt, n_out, out_ids = ref.completion(m, prompt, 12)
            r = client.completions.create(model=m, prompt=prompt, max_tokens=12, temperature=0)
            assert r.choices[0].text == want
            assert r.choices[0].finish_reason == _reason(out_ids, 12)
            assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, n_out)
            chunks = list(client.completions.create(model=m, prompt=prompt, max_tokens=12, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}))
            assert "".join(c.choices[0].text for c in chunks if c.choices) == want
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == _reason(out_ids, 12)
            assert chunks[-1].usage.completion_tokens == n_out and chunks[-1].usage.prompt_tokens == n_prompt


def test_chat_three_models_stream_equals_nonstream_and_reference(client, ref):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Which model is loaded?"}]
    for m in MODELS:
        want, n_prompt, n_out, out_ids = ref.chat(m, messages, 10)
        r = client.chat.completions.create(model=m, messages=messages, max_tokens=10, temperature=0)
        assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, n_out)
        chunks = list(client.chat.completions.create(model=m, messages=messages, max_tokens=10, temperature=0,
                                                     stream=True))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
        assert chunks[-1].choices[0].finish_reason == _reason(out_ids, 10)


def test_sampling_with_seed_is_reproducible(client):
    kw = dict(model="m1", prompt="GPU memory", max_tokens=8, temperature=0.9, top_p=0.9, seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


def test_stop_strings_cut_the_text_streamed_or_not(client, ref):
    full, _, _, _ = ref.completion("m2", PROMPTS[0], 24)
    stop = next(full[i:i + 2] for i in range(3, len(full) - 2) if full[i:i + 2].strip())
    cut = full[:full.find(stop)]
    r = client.completions.create(model="m2", prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop, "\x00"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="m2", prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_models_health_and_states(server, client, http):
    client.completions.create(model="m2", prompt="x", max_tokens=2, temperature=0)
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"m0", "m1", "m2", "nochat", "q"}
    assert client.models.retrieve("m2").model_dump()["state"] == "resident"
    body = http.get("/v1/models").json()
    states = {m["id"]: m["state"] for m in body["data"]}
    assert states["m2"] == "resident" and all(states[m] == "offloaded" for m in ("m0", "m1", "nochat", "q"))
    described = {m["id"]: (m["chat_template"], m["tool_call_parser"], m["max_model_len"]) for m in body["data"]}
    assert described["m0"] == (True, "hermes", 2048) and described["nochat"] == (False, "hermes", 2048)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    status = httpx.get(server.url + "/api/status").json()
    assert {m["id"]: m["state"] for m in status["models"]}["m2"] == "resident"
    assert status["models"][2]["last_load"]["bytes"] > 0


def _check_error(resp, status, param=None, code=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def test_error_statuses_in_openai_shape(server, http, client):
    url = server.url
    body = {"model": "m0", "prompt": "hi", "max_tokens": 2}
    _check_error(httpx.post(url + "/v1/completions", json=body), 401, code="invalid_api_key")
    _check_error(httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"}), 401)
    _check_error(httpx.get(url + "/v1/models"), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    _check_error(http.post("/v1/completions", json={**body, "model": "nope"}), 404, "model", "model_not_found")
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    _check_error(http.post("/v1/completions", json={**body, "n": 17}), 400, "n")  # server.max_n: 16
    _check_error(http.post("/v1/completions", json={**body, "logit_bias": {"x": 1}}), 400, "logit_bias")
    assert http.post("/v1/completions", json={**body, "frobnicate": 1}).status_code == 200  # ignored, logged
    _check_error(http.post("/v1/completions", json={**body, "temperature": 7}), 400, "temperature")
    assert http.post("/v1/completions", json={**body, "stop": ["a"] * 5}).status_code == 200  # any number
    _check_error(http.post("/v1/completions", json={"model": "m0"}), 400, "prompt")
    _check_error(http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}),
                 400)
    # the engine refuses these: param names the request's field, the message carries no engine prefix
    err = _check_error(http.post("/v1/completions", json={**body, "max_tokens": 5000}), 400, "max_tokens")
    assert err["message"].startswith("max_tokens=5000: the prompt has ") and "2048 positions" in err["message"]
    err = _check_error(http.post("/v1/completions", json={"model": "m0", "prompt": [5] * 2048}), 400, "prompt")
    assert "malformed" not in err["message"] and "'m0'" not in err["message"], err
    _check_error(http.post("/v1/completions", json={**body, "prompt": [5, 9999]}), 400, "prompt")
    _check_error(http.post("/v1/chat/completions", json={"model": "nochat", "messages": [
        {"role": "user", "content": "hi"}]}), 400, "messages", "chat_template_missing")
    _check_error(http.post("/v1/chat/completions", json={"model": "m0", "messages": []}), 400, "messages")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m0", prompt="hi", n=100)
    ok = client.completions.create(model="m0", prompt="hi", max_tokens=2, n=1, echo=False, presence_penalty=0)
    assert ok.choices[0].finish_reason in ("stop", "length")  # OpenAI's defaults are accepted


def test_queue_full_is_429_with_retry_after(server, http):
    """Model q takes one sequence at a time (max_batch_size 1) and queues one more (queue_size 1)."""
    long = {"model": "q", "prompt": LONG, "max_tokens": 1500, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=long) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: dropping the iterator would close the response
        assert next(line for line in lines if line.startswith("data: "))
        waiting = {}
        t = threading.Thread(target=lambda: waiting.update(r=http.post("/v1/completions", json={
            "model": "q", "prompt": "me next", "max_tokens": 2, "temperature": 0})))
        t.start()
        deadline = time.monotonic() + 60
        while {m["id"]: m for m in http.get("/api/status").json()["models"]}["q"]["waiting"] < 1:
            assert time.monotonic() < deadline and t.is_alive(), "the second request was never queued"
            time.sleep(0.02)  # bounded wait until the second request is queued
        r3 = http.post("/v1/completions", json={"model": "q", "prompt": "one too many", "max_tokens": 2})
        _check_error(r3, 429, code="queue_full")
        assert int(r3.headers["retry-after"]) >= 1  # the expected wait of the one ahead, whole seconds
        assert r3.headers["server-timing"].startswith("admission;dur=")
        assert 'computron_rejections_total{model="q",reason="queue_full"}' in http.get("/metrics").text
    t.join(60)  # closing the long stream frees the slot: the queued request is answered
    assert waiting["r"].status_code == 200, waiting["r"].text


def test_hundred_concurrent_requests_across_models(server, ref):
    reqs = [(MODELS[i % 3], PROMPTS[i % len(PROMPTS)], i % 4 == 0) for i in range(100)]

    async def one(c, m, prompt, stream):
        body = {"model": m, "prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": stream}
        if not stream:
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = sse_events([line async for line in r.aiter_lines()])
        assert events[-1] == "[DONE]"
        return "".join(e["choices"][0]["text"] for e in events[:-1])

    async def go():
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
        async with httpx.AsyncClient(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"},
                                     timeout=240, limits=limits) as c:
            return await asyncio.gather(*[one(c, *r) for r in reqs])
    outs = asyncio.run(go())
    for (m, prompt, _), out in zip(reqs, outs):
        assert out == ref.completion(m, prompt, 6)[0], (m, prompt)


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_the_sequence(server, http, stream):
    before = metrics(server.url)
    steps0 = metric(before, "computron_steps_total", model="m1")
    body = {"model": "m1", "prompt": LONG, "max_tokens": 1500, "temperature": 0, "stream": stream}
    if stream:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
    else:  # the client gives up waiting and closes its connection
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=httpx.Timeout(10, read=0.5))
    # the connection is closed: the server cancels the sequence and the engine drops it
    deadline = time.monotonic() + 60
    while True:
        snap = {m["id"]: m for m in httpx.get(server.url + "/api/status").json()["models"]}["m1"]
        after = metrics(server.url)
        done = metric(after, "computron_requests_total", model="m1", endpoint="completions", outcome="cancelled")
        if snap["running"] == 0 and snap["waiting"] == 0 and done == 1 + metric(
                before, "computron_requests_total", model="m1", endpoint="completions", outcome="cancelled"):
            break
        assert time.monotonic() < deadline, (snap["running"], snap["waiting"], {
            dict(k[1])["outcome"]: v - before.get(k, 0.0) for k, v in after.items()
            if k[0] == "computron_requests_total" and dict(k[1]).get("model") == "m1"})
        time.sleep(0.05)  # bounded wait for the cancellation to reach the engine
    steps = metric(after, "computron_steps_total", model="m1") - steps0
    assert steps < 750, f"{steps} decode steps: the sequence ran on after the client left"
    # and the model still serves
    assert http.post("/v1/completions", json={**body, "stream": False, "max_tokens": 3}).status_code == 200
    assert metric(after, "computron_requests_total", model="m1", endpoint="completions", outcome="ok") == metric(
        before, "computron_requests_total", model="m1", endpoint="completions", outcome="ok")


def test_metrics_parse_and_count_the_requests_sent(server, client, http):
    client.completions.create(model="m0", prompt="warm", max_tokens=2, temperature=0)  # m0 resident
    before = metrics(server.url)
    sent = Counter()
    for m in ("m1", "m2", "m0"):  # three swaps: m0 -> m1 -> m2 -> m0
        client.completions.create(model=m, prompt="count me", max_tokens=3, temperature=0)
        sent[(m, "completions", "ok")] += 1
    list(client.chat.completions.create(model="m0", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                        temperature=0, stream=True))
    sent[("m0", "chat", "ok")] += 1
    http.post("/v1/completions", json={"model": "ghost", "prompt": "x"})
    sent[("_unknown", "completions", "unknown_model")] += 1
    http.post("/v1/completions", json={"model": "m0", "prompt": "x", "n": 17})  # above server.max_n
    sent[("m0", "completions", "bad_request")] += 1
    after = metrics(server.url)
    for (m, ep, outcome), n in sent.items():
        key = dict(model=m, endpoint=ep, outcome=outcome)
        assert metric(after, "computron_requests_total", **key) - metric(before, "computron_requests_total",
                                                                          **key) == n, key
    for m in ("m0", "m1", "m2"):
        for kind in ("load", "offload"):
            d = metric(after, "computron_swaps_total", model=m, kind=kind) - metric(
                before, "computron_swaps_total", model=m, kind=kind)
            assert d == 1, (m, kind, d)
        assert metric(after, "computron_swap_bytes_total", model=m, kind="load") > 0
        assert metric(after, "computron_swap_seconds_total", model=m, kind="load") > 0
    assert metric(after, "computron_e2e_request_latency_seconds_count", model="m0") - metric(
        before, "computron_e2e_request_latency_seconds_count", model="m0") == 2
    assert metric(after, "computron_time_to_first_token_seconds_count", model="m0") - metric(
        before, "computron_time_to_first_token_seconds_count", model="m0") == 2  # streamed or not
    assert metric(after, "computron_resident_models") == 1
    assert metric(after, "computron_model_resident", model="m0") == 1
    assert metric(after, "computron_queue_depth", model="m1") == 0
    assert metric(after, "computron_engine_alive") == 1


# ---- error statuses that need the engine in a given state: a stub engine behind a live server ---------

class StubEngine(StubEngineBase):
    """Answers two tokens, or raises what the test sets (before the first token or mid-stream)."""

    def __init__(self):
        super().__init__("s0")
        self.mid_stream_error = None

    async def submit(self, model_id, data, timeout=None):
        if self.error:
            raise self.error
        return torch.tensor([300, 301])

    async def stream(self, model_id, data, timeout=None):
        if self.error:
            raise self.error
        yield 300
        if self.mid_stream_error:
            raise self.mid_stream_error
        yield 301


def test_engine_error_statuses_and_mid_stream_error_event(ckpts):
    engine = StubEngine()
    app = create_app(engine, {"s0": ModelText("s0", ckpts["m0"])}, ServerSettings())
    with app_in_thread(app) as url:
        body = {"model": "s0", "prompt": "hi", "max_tokens": 2}
        assert httpx.post(url + "/v1/completions", json=body).status_code == 200
        engine.error = QueueFullError("model 's0' already has 4 waiting requests (queue_size=4)")
        r = httpx.post(url + "/v1/completions", json=body)
        _check_error(r, 429, code="queue_full")
        assert r.headers["retry-after"] == "1"
        _check_error(httpx.post(url + "/v1/completions", json={**body, "stream": True}), 429)
        engine.error = RequestTimeoutError("request 7 to model 's0' took over 1s")
        _check_error(httpx.post(url + "/v1/completions", json=body), 504, code="request_timeout")
        engine.error = None
        engine.mid_stream_error = EngineDeadError("engine is dead: worker rank 1 exited unexpectedly")
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            events = sse_events(list(r.iter_lines()))
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_dead"
        with pytest.raises(openai.APIError):  # the official client raises on the error event
            for _ in openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).completions.create(
                    model="s0", prompt="hi", max_tokens=2, stream=True):
                pass
        engine.dead = "engine is dead: worker rank 1 exited unexpectedly"
        assert httpx.get(url + "/health").status_code == 503
        _check_error(httpx.post(url + "/v1/completions", json=body), 503, code="engine_dead")


async def _asgi(app, method, path, body=b"", gone=False):
    """One request straight into the ASGI app; ``gone``: the client closed its connection before the server
    read its body (uvicorn then answers the app's first read with a disconnect). Returns (status, body)."""
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "path": path,
             "raw_path": path.encode(), "root_path": "", "scheme": "http", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    sent = [{"type": "http.disconnect"}] if gone else [{"type": "http.request", "body": body, "more_body": False}]
    answer = {"status": None, "body": b""}

    async def receive():
        return sent.pop(0) if sent else {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            answer["status"] = message["status"]
        elif message["type"] == "http.response.body":
            answer["body"] += message.get("body", b"")
    await app(scope, receive, send)
    return answer["status"], answer["body"]


def test_a_client_gone_before_its_body_is_read_is_a_499_that_reaches_no_engine(ckpts):
    engine = StubEngine()
    engine.error = AssertionError("the engine was asked for a request whose client had gone")
    app = create_app(engine, {"s0": ModelText("s0", ckpts["m0"])}, ServerSettings())

    async def scenario():
        body = json.dumps({"model": "s0", "prompt": "hi", "max_tokens": 2}).encode()
        assert (await _asgi(app, "POST", "/v1/completions", body))[0] == 500  # the engine's error is reached...
        for path in ("/v1/completions", "/v1/chat/completions", "/v2/models/s0/infer", "/v2/repository/index"):
            assert (await _asgi(app, "POST", path, body, gone=True))[0] == 499, path  # ...not when gone
        return (await _asgi(app, "GET", "/metrics"))[1].decode()
    samples = parse_metrics(asyncio.run(scenario()))
    assert metric(samples, "computron_requests_total", model="s0", endpoint="completions", outcome="error") == 1
    cancelled = {dict(k[1])["endpoint"]: v for k, v in samples.items()
                 if k[0] == "computron_requests_total" and dict(k[1]).get("outcome") == "cancelled"}
    assert cancelled == {"completions": 1, "chat": 1, "v2_infer": 1}


# ---- lifecycle: their own servers --------------------------------------------------------------------

def test_sigterm_drains_in_flight_streams_and_leaves_no_process(ckpts, tmp_path):
    srv = ServerProcess(str(tmp_path), {"m0": ckpts["m0"]}, server={"shutdown_grace_s": 60})
    try:
        assert len(srv.engine_workers) == 1, "the server should have spawned its worker"
        body = {"model": "m0", "prompt": LONG, "max_tokens": 400, "temperature": 0, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            srv.proc.send_signal(signal.SIGTERM)  # mid-stream
            events = sse_events([first, *lines])
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert not any("error" in e for e in events[:-1])
        assert srv.proc.wait(60) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(srv.url + "/health", timeout=5)
        _, alive = psutil.wait_procs(srv.workers, timeout=30)
        assert not alive, "workers left behind"
        assert "draining" in srv.log() and "engine stopped" in srv.log()
    finally:
        srv.stop()


def test_request_timeout_504_then_engine_death_ends_streams(ckpts, tmp_path):
    srv = ServerProcess(str(tmp_path), {"m0": ckpts["m0"], "m1": ckpts["m1"]},
                        server={"request_timeout_s": 1.5, "engine_restarts": 0})  # restarts: test_engine_restart
    try:
        c = httpx.Client(base_url=srv.url, timeout=60)
        slow = {"model": "m0", "prompt": LONG, "max_tokens": 2000, "temperature": 0}
        _check_error(c.post("/v1/completions", json=slow), 504, code="request_timeout")
        assert c.post("/v1/completions", json={**slow, "max_tokens": 2}).status_code == 200  # still serving
        with c.stream("POST", "/v1/completions", json={**slow, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            os.kill(srv.engine_workers[0].pid, signal.SIGKILL)  # the engine dies mid-stream
            events = sse_events([first, *lines])
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_dead", events[-3:]
        assert c.get("/health").status_code == 503
        _check_error(c.post("/v1/completions", json={**slow, "max_tokens": 2}), 503, code="engine_dead")
        m = metrics(srv.url)
        assert metric(m, "computron_engine_alive") == 0
        assert metric(m, "computron_requests_total", model="m0", endpoint="completions", outcome="timeout") == 1
        c.close()
    finally:
        rc, alive = srv.stop()
    assert rc == 0 and not alive


def test_bad_config_fails_before_any_worker_starts(ckpts, tmp_path, capsys):
    from computron.server.cli import main
    cases = [
        (["serve", str(tmp_path / "missing")], "models[0].path"),
        (["serve", ckpts["m0"], ckpts["m0"]], "duplicate model id"),
        (["serve", ckpts["m0"], "--tp", "0"], "engine.tp"),
        (["serve", ckpts["m0"], "--max-loaded", "0"], "engine.max_loaded"),
        (["serve", str(tmp_path)], "no config.json"),
        (["serve"], "no models"),
        (["serve", ckpts["m0"], "--tp", "3", "--port", "0"], "num_attention_heads=4, not divisible by "
                                                            "tp_world_size=3"),
        (["serve", ckpts["m0"], "--groups", "2"], "--groups and --ray-address need --ray"),
    ]
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"models: [{{id: a, path: {ckpts['m0']}}}]\nengine: {{max_loded: 2}}\n")
    cases.append((["serve", "--config", str(cfg)], "engine.max_loded: unknown field"))
    cfg2 = tmp_path / "d.yaml"
    cfg2.write_text(f"models: [{{id: a, path: {ckpts['m0']}, dtype: float8}}]\nserver: {{port: 99999}}\n")
    cases.append((["serve", "--config", str(cfg2)], "models[0].dtype"))
    cfg3 = tmp_path / "e.yaml"
    cfg3.write_text(f"models: [{{id: a, path: {ckpts['m0']}}}]\nserver: {{api_keys: [''], colour: red}}\n")
    cases.append((["serve", "--config", str(cfg3)], "server.colour"))
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}  # the shared server may be running
    for argv, needle in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, (argv, err)
        assert not {p.pid for p in me.children(recursive=True)} - before, "a worker started for a bad config"


def test_an_error_found_after_the_fork_server_started_leaves_no_process(ckpts, tmp_path):
    """`computron serve` starts the workers' fork server before it reads tokenizers and checkpoint configs
    (its imports run meanwhile); a shape error found there ends the command with exit code 2 and takes
    the server with it, though it is still importing torch (else it would outlive the command by
    seconds, holding the command's stdout and stderr open)."""
    tag = f"{os.getpid()}-{time.monotonic_ns()}"  # inherited by whatever the command starts, and by nothing else
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "computron", "serve", ckpts["m0"], "--tp", "3", "--port", "0"],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, "COMPUTRON_TEST_TAG": tag})
        assert proc.wait(120) == 2
    left = [p for p in psutil.process_iter(["cmdline", "environ"])
            if (p.info["environ"] or {}).get("COMPUTRON_TEST_TAG") == tag
            and "forkserver import main" in " ".join(p.info["cmdline"] or [])]
    assert not left, [(p.pid, p.info["cmdline"]) for p in left]
    stderr = (tmp_path / "stderr").read_text()
    assert "not divisible by tp_world_size=3" in stderr and stderr.count("\n") == 1, stderr


def test_port_in_use_fails_before_any_worker_starts(ckpts, tmp_path):
    """The HTTP port is bound in preflight, before the tokenizers and the workers: taken, it ends the
    command at once with exit code 2 and one line naming it."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "computron", "serve", ckpts["m0"], "--port", str(port)],
                              cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and not proc.stdout, proc.stderr
    assert f"server.port={port}: port {port} on 127.0.0.1 is already in use" in proc.stderr, proc.stderr
    assert "starting" not in proc.stderr and "worker" not in proc.stderr, proc.stderr


def test_full_config_file_maps_onto_engine_and_server_settings(ckpts, tmp_path):
    from computron.server.cli import _parser, build_config
    cfg_file = tmp_path / "serve.yaml"
    cfg_file.write_text(f"""
models:
  - {{id: small, path: {ckpts['m0']}, dtype: bfloat16, max_batch_size: 2, queue_size: 5}}
  - {{id: other, path: {ckpts['m1']}}}
engine: {{tp: 2, pp: 1, max_loaded: 2, queue_size: 10, prefetch: false}}
server: {{host: 0.0.0.0, port: 9000, api_keys: [k1, k2], request_timeout_s: 30, shutdown_grace_s: 5}}
""")
    cfg = build_config(_parser().parse_args(["serve", "--config", str(cfg_file), "--port", "9001"]))
    assert [(m.id, m.dtype, m.max_batch_size, m.queue_size) for m in cfg.models] == [
        ("small", "bfloat16", 2, 5), ("other", None, None, None)]
    assert (cfg.tp, cfg.pp, cfg.engine.max_loaded, cfg.engine.queue_size, cfg.engine.prefetch) == (2, 1, 2, 10, False)
    s = cfg.server
    assert (s.host, s.port, s.api_keys, s.request_timeout_s, s.drain_s) == ("0.0.0.0", 9001, ["k1", "k2"],
                                                                                      30, 5)
    quick = build_config(_parser().parse_args(["serve", ckpts["m0"], f"b={ckpts['m1']}", "--tp", "2",
                                               "--max-loaded", "1"]))
    assert [m.id for m in quick.models] == ["m0", "b"] and quick.tp == 2 and quick.engine.max_loaded == 1


def test_drain_s_and_its_old_name_shutdown_grace_s():
    from computron.server.config import ConfigError, parse_server
    assert parse_server({"drain_s": 5}).drain_s == 5
    assert parse_server({"shutdown_grace_s": 7}).drain_s == 7  # the YAML key README examples use
    assert ServerSettings().drain_s == 30.0
    with pytest.raises(ConfigError, match="server.shutdown_grace_s=0: must be > 0"):
        parse_server({"shutdown_grace_s": 0})
    with pytest.raises(ConfigError, match="give only one"):
        parse_server({"shutdown_grace_s": 7, "drain_s": 5})
