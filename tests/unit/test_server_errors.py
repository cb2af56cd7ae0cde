"""Errors and metrics of `computron serve` that need no workers: a stub engine behind an in-thread server.

- every status answers in OpenAI's error shape (v2's under /v2), FastAPI's own 404/405/422 included;
- `GET /v1/models/{id}` (the official client's `models.retrieve`);
- an engine validation error reaches HTTP with `param` naming the request's field and no internal prefix;
- which routes need the API key;
- non-streamed requests count in the time-to-first-token and time-per-output-token histograms;
- the batch managers name the field they refuse (max_tokens bounded by the model's positions, images
  decoded whole at submit time);
- one error table behind both shapes, one residency vocabulary, and the engine contract (``EngineClient``)
  that the engine and the stub both keep.
"""
import base64
import io

import httpx
import openai
import pytest
import torch
from serve_helpers import StubEngineBase, app_in_thread, write_checkpoints

from computron import zoo_understanding as zu
from computron.errors import PayloadError
from computron.batching.causal_lm import CausalLMBatchManager
from computron.server import create_app
from computron.server.config import ServerSettings
from computron.server.text import ModelText
from computron.engine.protocol import EngineClient
from computron.server.errors import ERROR_TABLE, to_openai, to_v2
from computron.server.residency import Residency
from computron.server.v2 import payload_message
from computron.batching.images import ImageClassificationBatchManager

pytestmark = pytest.mark.timeout(300)

KEY = "sk-errors"
AUTH = {"Authorization": f"Bearer {KEY}"}


class StubEngine(StubEngineBase):
    """Streams two tokens, or raises ``error`` at submit time."""

    def __init__(self):
        super().__init__("s0")

    async def submit(self, model_id, data, timeout=None):
        raise AssertionError("the server takes answers token by token (engine.stream)")

    async def stream(self, model_id, data, timeout=None):
        if self.error:
            raise self.error
        yield 300
        yield 301


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(engine, base URL) of a stub engine serving model s0 behind an API key."""
    path = write_checkpoints(str(tmp_path_factory.mktemp("errors-ckpt")), n=1)["m0"]
    engine = StubEngine()
    app = create_app(engine, {"s0": ModelText("s0", path)}, ServerSettings(api_keys=[KEY]))
    with app_in_thread(app) as url:
        yield engine, url


def openai_error(resp, status):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return body["error"]


def v2_error(resp, status):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"], body
    return body["error"]


def metric(url, name, **labels):
    from prometheus_client.parser import text_string_to_metric_families
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


# ---- shapes and routes ----------------------------------------------------------------------------------

def test_models_retrieve_with_the_official_client(served):
    _, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    m = client.models.retrieve("s0")
    assert (m.id, m.object, m.owned_by) == ("s0", "model", "computron")
    assert m.model_dump()["state"] == "resident"
    assert [x.id for x in client.models.list().data] == ["s0"]
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert e.value.body["param"] == "model" and e.value.body["code"] == "model_not_found"
    err = openai_error(httpx.get(url + "/v1/models/nope", headers=AUTH), 404)
    assert "nope" in err["message"]
    openai_error(httpx.get(url + "/v1/models/s0"), 401)  # the key is checked first


def test_fastapi_errors_answer_in_the_shape_of_their_route(served):
    _, url = served
    err = openai_error(httpx.get(url + "/v1/nothing", headers=AUTH), 404)
    assert "/v1/nothing" in err["message"] and err["code"] == "not_found"
    openai_error(httpx.get(url + "/nothing"), 404)
    r = httpx.get(url + "/v1/completions", headers=AUTH)
    err = openai_error(r, 405)
    assert err["code"] == "method_not_allowed" and "POST" in err["message"] and r.headers["allow"] == "POST"
    openai_error(httpx.delete(url + "/v1/models", headers=AUTH), 405)
    err = openai_error(httpx.get(url + "/api/events", params={"since": "yesterday"}), 400)  # FastAPI's 422
    assert err["param"] == "since" and err["type"] == "invalid_request_error"
    err = openai_error(httpx.post(url + "/v1/completions", content=b"{not json", headers=AUTH), 400)
    assert "JSON" in err["message"]
    assert "/v2/nothing" in v2_error(httpx.get(url + "/v2/nothing"), 404)
    assert "DELETE" in v2_error(httpx.delete(url + "/v2/models/s0/infer", headers=AUTH), 405)
    assert "v2 models" in v2_error(httpx.get(url + "/v2/models/s0", headers=AUTH), 404)


def test_api_keys_protect_v1_and_v2_models_routes(served):
    _, url = served
    protected = [("GET", "/v1/models"), ("GET", "/v1/models/s0"), ("POST", "/v1/completions"),
                 ("POST", "/v1/chat/completions"), ("POST", "/v1/embeddings"), ("GET", "/v2/models/s0"),
                 ("GET", "/v2/models/s0/ready"), ("POST", "/v2/models/s0/infer")]
    for method, path in protected:
        r = httpx.request(method, url + path, json={})
        assert r.status_code == 401, (method, path, r.text)
        err = r.json()["error"]
        assert "API key" in (err if path.startswith("/v2") else err["message"]), (path, err)
    for path in ("/health", "/metrics", "/", "/api/status", "/api/events", "/v2", "/v2/health/live",
                 "/v2/health/ready"):
        assert httpx.get(url + path).status_code == 200, path


# ---- engine validation errors over HTTP ----------------------------------------------------------------

@pytest.mark.parametrize("endpoint,body,engine_param,param", [
    ("completions", {"prompt": "hi", "max_tokens": 10 ** 6}, "max_tokens", "max_tokens"),
    ("completions", {"prompt": [5] * 3000}, "input_ids", "prompt"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10 ** 6},
     "max_tokens", "max_completion_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 ** 6},
     "max_tokens", "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x " * 3000}]}, "input_ids", "messages"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_engine_payload_errors_name_the_request_field(served, endpoint, body, engine_param, param, stream):
    engine, url = served
    reason = f"{engine_param}: too large for this model"
    engine.error = PayloadError(f"model 's0': malformed request: {reason}", engine_param, reason)
    try:
        r = httpx.post(f"{url}/v1/{endpoint}", json={"model": "s0", "stream": stream, **body}, headers=AUTH)
    finally:
        engine.error = None
    err = openai_error(r, 400)
    assert (err["param"], err["message"], err["code"]) == (param, reason, "invalid_payload")


# ---- histograms ----------------------------------------------------------------------------------------

def test_non_streamed_requests_count_in_the_token_histograms(served):
    _, url = served
    names = ("computron_time_to_first_token_seconds_count", "computron_time_per_output_token_seconds_count",
             "computron_e2e_request_latency_seconds_count")
    before = [metric(url, n, model="s0") for n in names]
    n = 4
    for i in range(n):
        body = {"model": "s0", "prompt": "hi", "max_tokens": 2, "stop": ["zzz"] if i % 2 else None}
        assert httpx.post(url + "/v1/completions", json=body, headers=AUTH).status_code == 200
    assert [metric(url, name, model="s0") - b for name, b in zip(names, before)] == [n, n, n]


# ---- batch managers name the field they refuse -----------------------------------------------------------

def refused(bm, data):
    with pytest.raises(PayloadError) as e:
        bm.validate(data)
    return e.value.param, str(e.value)


def test_max_tokens_is_bounded_by_the_model_positions_minus_the_prompt():
    bm = CausalLMBatchManager(vocab_size=512, max_positions=2048)
    assert refused(bm, {"input_ids": [5] * 12, "max_tokens": 10 ** 6}) == (
        "max_tokens", "max_tokens=1000000: the prompt has 12 tokens and the model has 2048 positions, so "
                      "max_tokens must be at most 2036")
    bm.validate({"input_ids": [5] * 12, "max_tokens": 2036})
    param, msg = refused(bm, {"input_ids": [5] * 2048, "max_tokens": 1})
    assert param == "input_ids" and "2048 positions" in msg
    assert refused(bm, {"input_ids": [5], "max_tokens": 0})[0] == "max_tokens"
    assert refused(bm, {"input_ids": [5], "temperature": -1})[0] == "temperature"
    assert refused(bm, {"input_ids": [5], "bogus": 1})[0] == "bogus"
    assert refused(bm, {"input_ids": [5, 600]})[0] == "input_ids"
    CausalLMBatchManager(max_positions=32768).validate({"input_ids": [5], "max_tokens": 30000})  # no 4096 cap
    assert refused(CausalLMBatchManager(), {"input_ids": [5], "max_tokens": 5000})[0] == "max_tokens"


def test_an_undecodable_image_fails_at_submit_naming_the_input(tmp_path):
    from PIL import Image
    bm = ImageClassificationBatchManager.for_checkpoint(zu.save_random_encoder("vit", str(tmp_path / "vit"),
                                                                               "image", seed=3))
    buf = io.BytesIO()
    Image.fromarray(torch.randint(0, 256, (28, 40, 3), dtype=torch.uint8).numpy()).save(buf, format="PNG")
    png = buf.getvalue()
    bm.validate({"image": png})
    for bad in (png[:len(png) // 2], base64.b64encode(png[:len(png) - 40]).decode(), b"not an image"):
        param, msg = refused(bm, {"image": bad})
        assert param == "image" and "no image PIL can read" in msg, msg
    e = PayloadError("model 'vit': malformed request: image: the bytes are no image PIL can read (OSError: x)",
                     "image", "image: the bytes are no image PIL can read (OSError: x)")
    assert payload_message(e) == "input 'image': the bytes are no image PIL can read (OSError: x)"
    assert payload_message(e, 2, "pixel_values") == "input 'image': row 2: the bytes are no image PIL can read " \
                                                    "(OSError: x)"


# ---- the error table, the residency names, the engine contract -------------------------------------------

def test_one_error_table_answers_both_shapes():
    for cls, kind in ERROR_TABLE:
        two = {"UnknownModelError": ("m", ["m"]), "AdapterError": ("a", "went wrong")}  # (id, more)
        exc = cls(*two[cls.__name__]) if cls.__name__ in two else cls("x: went wrong")
        openai_err, v2_err = to_openai(exc), to_v2(exc)
        assert (openai_err.status, openai_err.code, openai_err.headers) == (kind.status, kind.code, kind.headers())
        assert (v2_err.status, v2_err.headers) == (kind.status, kind.headers()), cls
    assert to_v2(PayloadError("model 'm': malformed request: x: bad", "x", "x: bad")).message == "input 'x': bad"
    crash = to_v2(ZeroDivisionError("oops"))
    assert crash.status == 500 and crash.message == "internal error: ZeroDivisionError: oops"


def test_residency_names_one_state_for_every_view():
    from computron.engine import ModelSnapshot

    def snap(state, tier):
        return ModelSnapshot(state=state, tier=tier, waiting=0, running=0, paused=0, token_level=True, pinned=False)
    seen = {(s, t): Residency.of(snap(s, t)) for s, t in [("loaded", "device"), ("loading", "host"),
                                                           ("offloading", "device"), ("offloaded", "host"),
                                                           ("offloaded", "disk")]}
    assert [r.value for r in seen.values()] == ["resident", "loading", "offloading", "host", "disk"]
    assert [r.openai_state for r in seen.values()] == ["resident", "loading", "offloaded", "offloaded", "offloaded"]
    assert Residency.of(None) is Residency.HOST


def test_the_engine_and_the_stub_keep_the_engine_client_contract():
    from computron.engine import Engine
    members = [n for n in vars(EngineClient) if not n.startswith("_")]
    assert {"submit", "stream", "snapshot", "is_alive", "dead_reason", "shutdown"} <= set(members)
    assert [n for n in members if not hasattr(Engine, n)] == []
    assert isinstance(StubEngine(), EngineClient)
