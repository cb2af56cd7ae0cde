"""The OpenAI features real clients use (issue 35), through the official ``openai`` client and httpx against the
server over a scripted engine: what each request becomes on the engine's side (the fields of the engine
contract, one request per choice and prompt), and how the engine's tokens and logprobs come back (choices,
logprobs, echo, tool calls, the Responses API, /tokenize). No worker process: the engine is a stub that
answers a canned text, token by token, as the real one streams.
"""
import json
import logging
from dataclasses import dataclass
from typing import Optional, Tuple

import httpx
import openai
import pytest
from serve_helpers import StubEngineBase, app_in_thread, write_checkpoints

from computron.errors import PayloadError
from computron.server import create_app
from computron.server.config import ServerSettings
from computron.server.text import ModelText

pytestmark = pytest.mark.timeout(300)

KEY = "sk-features"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
    "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}/nothink{% endif %}")


@dataclass(frozen=True)
class TokenLogprob:  # the engine contract's shape (computron.engine.protocol), read by duck typing
    token: int
    logprob: float
    top: Tuple[Tuple[int, float], ...]


@dataclass(frozen=True)
class PromptLogprobs:
    entries: Tuple[Optional[TokenLogprob], ...]


def _lp(tok, i, k):
    return TokenLogprob(tok, -0.25 - i, tuple((tok + j, -0.25 - i - j) for j in range(k)))


class ScriptedEngine(StubEngineBase):
    """Answers every generation request with ``reply`` (tokenized), up to its max_tokens, then EOS; logprobs
    and prompt logprobs as the contract streams them; ``error`` raised at submit time."""

    def __init__(self, text):
        super().__init__("s0")
        self.text = text
        self.reply = "Hello there, friend."
        self.requests = []

    async def submit(self, model_id, data, timeout=None):
        raise AssertionError("generation goes through engine.stream")

    async def stream(self, model_id, data, timeout=None):
        self.requests.append(data)
        if self.error:
            raise self.error
        reply = self.reply(data) if callable(self.reply) else self.reply
        ids = self.text.encode(reply, add_special_tokens=False)[:data["max_tokens"]]
        if len(ids) < data["max_tokens"] and not data.get("ignore_eos"):
            ids.append(self.text.eos_token_id)
        k = data.get("logprobs")
        scored = k is not None or data.get("prompt_logprobs") is not None
        if data.get("prompt_logprobs") is not None:
            p = data["input_ids"]
            yield PromptLogprobs((None,) + tuple(_lp(t, i, data["prompt_logprobs"]) for i, t in enumerate(p[1:])))
        for i, t in enumerate(ids):
            yield _lp(t, i, k or 0) if scored else t


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = write_checkpoints(str(tmp_path_factory.mktemp("features-ckpt")), n=1)["m0"]
    text = ModelText("s0", path)
    text.tokenizer.chat_template = TEMPLATE
    engine = ScriptedEngine(text)
    app = create_app(engine, {"s0": text}, ServerSettings(api_keys=[KEY]), max_positions={"s0": 2048})
    with app_in_thread(app) as url:
        yield engine, url, text


@pytest.fixture
def engine(setup):
    e = setup[0]
    e.requests.clear()
    e.reply, e.error = "Hello there, friend.", None
    return e


@pytest.fixture(scope="module")
def client(setup):
    return openai.OpenAI(base_url=setup[1] + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(setup):
    with httpx.Client(base_url=setup[1], headers=AUTH, timeout=60) as c:
        yield c


def _error(resp, status, param):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param, err
    return err


# ---- engine fields -------------------------------------------------------------------------------------

def test_sampling_controls_map_onto_the_engine_fields(engine, client):
    r = client.completions.create(model="s0", prompt="hi", max_tokens=8, temperature=0.5, seed=3,
                                  presence_penalty=0.5, frequency_penalty=-0.25, logit_bias={"7": 5, "9": -100},
                                  stop=["a", "b", "c", "d", "e", "f"],
                                  extra_body={"repetition_penalty": 1.3, "min_p": 0.1, "min_tokens": 2,
                                              "ignore_eos": True, "stop_token_ids": [11, 12], "top_k": 4})
    assert r.choices[0].finish_reason in ("stop", "length")
    d = engine.requests[-1]
    assert {k: v for k, v in d.items() if k != "input_ids"} == {
        "max_tokens": 8, "temperature": 0.5, "seed": 3, "top_k": 4, "presence_penalty": 0.5,
        "frequency_penalty": -0.25, "logit_bias": {7: 5.0, 9: -100.0}, "repetition_penalty": 1.3, "min_p": 0.1,
        "min_tokens": 2, "ignore_eos": True, "stop_token_ids": [11, 12]}
    client.chat.completions.create(model="s0", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                   temperature=0)
    assert set(engine.requests[-1]) == {"input_ids", "max_tokens", "temperature"}  # nothing unset is sent


def test_bad_values_answer_400_naming_the_field(engine, http):
    body = {"model": "s0", "prompt": "hi", "max_tokens": 4}
    for field, value in (("presence_penalty", 3), ("frequency_penalty", "x"), ("repetition_penalty", 0),
                         ("logit_bias", {"a": 1}), ("logit_bias", {"5": 101}), ("min_p", 2), ("min_tokens", -1),
                         ("min_tokens", 9), ("ignore_eos", "yes"), ("stop_token_ids", [1, "x"]), ("n", 0),
                         ("n", 17), ("logprobs", 21), ("echo", 1), ("best_of", 2), ("stop", [1]),
                         ("response_format", {"type": "yaml"})):
        _error(http.post("/v1/completions", json={**body, field: value}), 400, field)
    chat = {"model": "s0", "messages": [{"role": "user", "content": "hi"}]}
    _error(http.post("/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 21}), 400, "top_logprobs")
    _error(http.post("/v1/chat/completions", json={**chat, "top_logprobs": 2}), 400, "top_logprobs")
    assert engine.requests == []


def test_unknown_fields_are_ignored_and_logged_once(engine, client, caplog):
    with caplog.at_level(logging.WARNING, logger="computron.server"):
        for _ in range(2):
            client.completions.create(model="s0", prompt="hi", max_tokens=2,
                                      extra_body={"frobnicate": 1, "user": "u", "metadata": {"a": "b"}})
    lines = [r.getMessage() for r in caplog.records if "frobnicate" in r.getMessage()]
    assert len(lines) == 1 and "ignoring the unknown request field 'frobnicate'" in lines[0]
    assert not any("'user'" in r.getMessage() or "'metadata'" in r.getMessage() for r in caplog.records)
    client.chat.completions.create(model="s0", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                   parallel_tool_calls=True, service_tier="auto", user="u",
                                   stream_options=None, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert engine.text.decode(engine.requests[-1]["input_ids"]).endswith("<|assistant|>/nothink")


def test_strict_mode_refuses_unknown_fields(setup):
    engine, _, text = setup
    app = create_app(engine, {"s0": text}, ServerSettings(strict_fields=True))
    with app_in_thread(app) as url:
        r = httpx.post(url + "/v1/completions", json={"model": "s0", "prompt": "hi", "frobnicate": 1})
        assert "frobnicate" in _error(r, 400, "frobnicate")["message"]
        ok = httpx.post(url + "/v1/completions", json={"model": "s0", "prompt": "hi", "max_tokens": 2, "user": "u"})
        assert ok.status_code == 200, ok.text


# ---- choices and prompts ------------------------------------------------------------------------------

def test_n_choices_with_seeds_and_a_batch_of_prompts(engine, client, setup):
    text = setup[2]
    r = client.completions.create(model="s0", prompt="hi", n=3, seed=5, max_tokens=3)
    assert [c.index for c in r.choices] == [0, 1, 2] and [d["seed"] for d in engine.requests] == [5, 6, 7]
    assert r.usage.prompt_tokens == len(text.encode("hi")) and r.usage.completion_tokens == 9
    engine.requests.clear()
    engine.reply = lambda d: text.decode(d["input_ids"][-1:]) + " ok"
    r = client.completions.create(model="s0", prompt=["alpha", [5, 6, 7]], n=2, max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [d["input_ids"] for d in engine.requests] == [text.encode("alpha")] * 2 + [[5, 6, 7]] * 2
    assert r.choices[0].text == r.choices[1].text and r.choices[2].text.endswith(" ok")
    chunks = list(client.completions.create(model="s0", prompt=["alpha", "beta"], max_tokens=4, stream=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts[0] == r.choices[0].text and set(texts) == {0, 1}
    assert sum(1 for c in chunks if c.choices[0].finish_reason) == 2


def test_finish_reasons(engine, client, setup):
    text = setup[2]
    assert client.completions.create(model="s0", prompt="hi", max_tokens=2).choices[0].finish_reason == "length"
    assert client.completions.create(model="s0", prompt="hi", max_tokens=50).choices[0].finish_reason == "stop"
    ids = text.encode(engine.reply, add_special_tokens=False)
    r = client.completions.create(model="s0", prompt="hi", max_tokens=len(ids),
                                  extra_body={"stop_token_ids": [ids[-1]]})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text.decode(ids[:-1])
    r = client.completions.create(model="s0", prompt="hi", max_tokens=50, stop=["there"])
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("Hello ", "stop")


# ---- logprobs ----------------------------------------------------------------------------------------

def test_completion_logprobs_and_echo_for_loglikelihood(engine, client, setup):
    text = setup[2]
    r = client.completions.create(model="s0", prompt="hi", max_tokens=3, logprobs=2)
    lp = r.choices[0].logprobs
    ids = text.encode(engine.reply, add_special_tokens=False)[:3]
    assert lp.tokens == [text.token_str(t) for t in ids] and lp.token_logprobs == [-0.25, -1.25, -2.25]
    assert lp.top_logprobs[0] == {text.token_str(ids[0]): -0.25, text.token_str(ids[0] + 1): -1.25}
    assert lp.text_offset[0] == 0 and "".join(lp.tokens).startswith(r.choices[0].text[:2])
    assert engine.requests[-1]["logprobs"] == 2 and "prompt_logprobs" not in engine.requests[-1]
    # lm-eval's loglikelihood request: token ids, echo, logprobs=1, max_tokens=1, temperature 0
    prompt = text.encode("The engine swaps models")
    r = client.completions.create(model="s0", prompt=[prompt, prompt[:3]], echo=True, logprobs=1, max_tokens=1,
                                  temperature=0)
    assert engine.requests[-1]["prompt_logprobs"] == 1
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(prompt)] == [-0.25 - i for i in range(len(prompt) - 1)]
    assert r.choices[0].text.startswith(text.decode(prompt)) and len(r.choices[1].logprobs.tokens) == 4
    r = client.completions.create(model="s0", prompt="The engine", echo=True, logprobs=0, max_tokens=0)
    assert r.choices[0].text == "The engine" and r.usage.completion_tokens == 0
    assert len(r.choices[0].logprobs.tokens) == len(text.encode("The engine"))
    chunks = list(client.completions.create(model="s0", prompt="The engine", echo=True, logprobs=1, max_tokens=3,
                                            stream=True))
    assert chunks[0].choices[0].text == "The engine"
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    whole = client.completions.create(model="s0", prompt="The engine", echo=True, logprobs=1, max_tokens=3)
    assert streamed == whole.choices[0].logprobs.token_logprobs


def test_chat_logprobs_streamed_and_not(engine, client, setup):
    text = setup[2]
    msgs = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="s0", messages=msgs, max_tokens=3, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    ids = text.encode(engine.reply, add_special_tokens=False)[:3]
    assert [c.token for c in content] == [text.token_str(t) for t in ids]
    assert content[0].bytes == list(content[0].token.encode()) and len(content[0].top_logprobs) == 2
    assert engine.requests[-1]["logprobs"] == 2
    chunks = list(client.chat.completions.create(model="s0", messages=msgs, max_tokens=3, logprobs=True,
                                                 stream=True))
    streamed = [c.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs
                for c in ch.choices[0].logprobs.content]
    assert streamed == [c.logprob for c in content]


# ---- structured output and tools -----------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_response_format_becomes_the_grammar_and_its_errors_name_it(engine, client, http):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    engine.reply = '{"a": 1}'
    r = client.chat.completions.create(model="s0", messages=[{"role": "user", "content": "hi"}], max_tokens=20,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert json.loads(r.choices[0].message.content) == {"a": 1}
    assert engine.requests[-1]["grammar"] == {"type": "json_schema", "schema": schema, "strict": True}
    client.completions.create(model="s0", prompt="x", max_tokens=5,
                              extra_body={"response_format": {"type": "json_object"}})
    assert engine.requests[-1]["grammar"] == {"type": "json_object"}
    engine.error = PayloadError("grammar: cannot compile", "grammar")
    _error(http.post("/v1/chat/completions", json={"model": "s0", "messages": [{"role": "user", "content": "hi"}],
                                                  "response_format": {"type": "json_object"}}), 400, "response_format")


def test_tool_calls_parsed_from_the_answer_streamed_and_not(engine, client):
    engine.reply = 'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model="s0", messages=msgs, tools=[WEATHER, TIME], max_tokens=200)
    prompt = engine.text.decode(engine.requests[-1]["input_ids"])
    assert prompt.startswith("<|tools|>get_weather;get_time;")  # the template rendered the tools
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content == "Let me check."
    assert m.tool_calls[0].function.name == "get_weather"
    assert json.loads(m.tool_calls[0].function.arguments) == {"city": "Paris"}
    assert m.tool_calls[0].id.startswith("call_")
    chunks = list(client.chat.completions.create(model="s0", messages=msgs, tools=[WEATHER], max_tokens=200,
                                                 stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert content == "Let me check." and len(calls) == 1 and calls[0].index == 0
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    r = client.chat.completions.create(model="s0", messages=msgs, tools=[WEATHER], tool_choice="none", max_tokens=200)
    assert r.choices[0].message.tool_calls is None and "<tool_call>" in r.choices[0].message.content


def test_a_tool_conversation_is_accepted_and_rendered(engine, client):
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}]
    r = client.chat.completions.create(model="s0", messages=msgs, tools=[WEATHER], max_tokens=20)
    assert r.choices[0].message.content == engine.reply
    prompt = engine.text.decode(engine.requests[-1]["input_ids"])
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    assert "<|tool|>sunny, 21C" in prompt


def test_forced_tool_choice_uses_the_grammar(engine, client, http):
    engine.reply = '{"city": "Oslo"}'
    msgs = [{"role": "user", "content": "Weather?"}]
    r = client.chat.completions.create(model="s0", messages=msgs, tools=[WEATHER, TIME], max_tokens=50,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert engine.requests[-1]["grammar"] == {"type": "json_schema", "strict": True,
                                              "schema": WEATHER["function"]["parameters"]}
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    engine.reply = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]'
    r = client.chat.completions.create(model="s0", messages=msgs, tools=[WEATHER, TIME], max_tokens=80,
                                       tool_choice="required")
    g = engine.requests[-1]["grammar"]["schema"]
    assert g["type"] == "array" and g["minItems"] == 1 and len(g["items"]["anyOf"]) == 2
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_time", "get_weather"]
    chunks = list(client.chat.completions.create(model="s0", messages=msgs, tools=[WEATHER, TIME], max_tokens=80,
                                                 tool_choice="required", stream=True))
    assert [tc.index for c in chunks for tc in (c.choices[0].delta.tool_calls or [])] == [0, 1]
    _error(http.post("/v1/chat/completions", json={"model": "s0", "messages": msgs, "tools": [WEATHER],
                                                  "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
           400, "tool_choice")
    _error(http.post("/v1/chat/completions", json={"model": "s0", "messages": msgs, "tool_choice": "required"}),
           400, "tool_choice")


# ---- other routes -------------------------------------------------------------------------------------

def test_tokenize_and_detokenize(engine, http, setup):
    text = setup[2]
    r = http.post("/tokenize", json={"model": "s0", "prompt": "hello world"}).json()
    assert r == {"tokens": text.encode("hello world"), "count": len(text.encode("hello world")), "max_model_len": 2048}
    r2 = http.post("/tokenize", json={"model": "s0", "prompt": "hello world", "add_special_tokens": False}).json()
    assert r2["tokens"] == text.encode("hello world", add_special_tokens=False)
    chat = http.post("/tokenize", json={"model": "s0", "messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == text.chat_ids([{"role": "user", "content": "hi"}])
    assert http.post("/detokenize", json={"model": "s0", "tokens": r2["tokens"]}).json() == {"prompt": "hello world"}
    _error(http.post("/detokenize", json={"model": "s0", "tokens": "x"}), 400, "tokens")
    _error(http.post("/tokenize", json={"model": "nope", "prompt": "x"}), 404, "model")


def test_models_say_tool_parser_and_chat_template(client):
    m = client.models.retrieve("s0").model_dump()
    assert m["tool_call_parser"] == "hermes" and m["chat_template"] is True and m["max_model_len"] == 2048


def test_responses_api_whole_and_streamed(engine, client):
    r = client.responses.create(model="s0", input="Say hello", instructions="Be brief", max_output_tokens=50)
    assert r.output_text == engine.reply and r.status == "completed" and r.usage.output_tokens > 0
    prompt = engine.text.decode(engine.requests[-1]["input_ids"])
    assert "<|system|>Be brief" in prompt and "<|user|>Say hello" in prompt
    events = list(client.responses.create(model="s0", input="Say hello", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == engine.reply
    assert [e.sequence_number for e in events] == list(range(len(events)))
    with client.responses.stream(model="s0", input="Say hello") as s:
        for _ in s:
            pass
        assert s.get_final_response().output_text == engine.reply
    r = client.responses.create(model="s0", input="x", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_responses_api_function_calls(engine, client):
    tool = {"type": "function", "name": "get_weather", "description": "weather",
            "parameters": WEATHER["function"]["parameters"]}
    engine.reply = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    r = client.responses.create(model="s0", input="Weather in Paris?", tools=[tool])
    call = r.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    with client.responses.stream(model="s0", input="Weather in Paris?", tools=[tool]) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and final.output[0].name == "get_weather"
    engine.reply = "It is sunny."
    r = client.responses.create(model="s0", tools=[tool], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": "get_weather", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert r.output_text == "It is sunny."
    prompt = engine.text.decode(engine.requests[-1]["input_ids"])
    assert '"city": "Paris"' in prompt and "<|tool|>sunny" in prompt
    engine.reply = '{"city": "Oslo"}'
    r = client.responses.create(model="s0", input="x", tools=[tool], tool_choice={"type": "function",
                                                                                   "name": "get_weather"})
    assert r.output[0].name == "get_weather" and engine.requests[-1]["grammar"]["type"] == "json_schema"


def test_responses_api_errors_name_their_fields(engine, http):
    body = {"model": "s0", "input": "x", "text": {"format": {"type": "json_schema", "name": "o",
                                                             "schema": {"type": "object"}}}}
    engine.error = PayloadError("grammar: cannot compile", "grammar")
    _error(http.post("/v1/responses", json=body), 400, "text.format")
    engine.error = None
    _error(http.post("/v1/responses", json={**body, "previous_response_id": "resp_1"}), 400, "previous_response_id")
    _error(http.post("/v1/responses", json={"model": "s0", "input": "x", "tools": [{"type": "web_search"}]}), 400,
           "tools[0]")
    _error(http.post("/v1/responses", json={"model": "s0", "input": "x", "max_output_tokens": 0}), 400,
           "max_output_tokens")
    assert engine.requests[-1]["grammar"] == {"type": "json_schema", "schema": {"type": "object"}, "strict": False}
