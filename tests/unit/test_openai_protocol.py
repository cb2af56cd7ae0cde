"""The torch-free parts of the OpenAI routes (issue 35), no server: request fields checked and mapped onto the
engine contract's fields, chat messages and tools normalized for HF chat templates, the tool-call parsers
(whole and streamed a character at a time), the forced-call grammar, logprob shapes, the Responses API's
input and event sequence, and the unknown-field policy.
"""
import json
import logging
import sys
from dataclasses import dataclass
from typing import Tuple

import pytest

from computron.server.errors import APIError
from computron.server.field_policy import FieldPolicy
from computron.server.openai import chat, logprobs, protocol, responses, tool_parsers
from computron.server.openai.tool_parsers import ToolCall

pytestmark = pytest.mark.unit


def _param(fn, *a):
    with pytest.raises(APIError) as e:
        fn(*a)
    assert e.value.status == 400
    return e.value.param


def test_the_policy_modules_import_no_torch():
    assert "computron.server.openai.answer" in sys.modules  # imported above through its users
    for mod in (chat, logprobs, protocol, responses, tool_parsers):
        assert "torch" not in getattr(mod, "__dict__")


# ---- request fields ---------------------------------------------------------------------------------------

def test_completion_fields_map_onto_engine_fields():
    p = protocol.parse_completion({"model": "m", "prompt": "x", "max_tokens": 5, "seed": 2, "presence_penalty": 1,
                                   "frequency_penalty": 0, "repetition_penalty": 1.0, "logit_bias": {"3": -1},
                                   "min_p": 0.2, "min_tokens": 1, "ignore_eos": False, "stop_token_ids": [4],
                                   "logprobs": 3, "echo": True, "stop": list("abcdefg"), "n": 2,
                                   "response_format": {"type": "json_object"}})
    data = protocol.engine_request(p, [1, 2], 16, 64)
    assert data == {"input_ids": [1, 2], "max_tokens": 5, "seed": 2, "temperature": 1.0, "presence_penalty": 1.0,
                    "logit_bias": {3: -1.0}, "min_p": 0.2, "min_tokens": 1, "stop_token_ids": [4], "logprobs": 3,
                    "prompt_logprobs": 3, "grammar": {"type": "json_object"},
                    "repetition_penalty": 1.0}  # kept: it overrides a generation config's; other no-ops are not sent
    assert p.stop == list("abcdefg") and p.n == 2
    assert [d["seed"] for d in protocol.choice_requests(data, 3)] == [2, 3, 4]
    assert [d.get("seed") for d in protocol.choice_requests({"max_tokens": 1}, 2)] == [None, None]


def test_max_tokens_zero_only_with_echo():
    assert _param(protocol.parse_completion, {"model": "m", "prompt": "x", "max_tokens": 0}) == "max_tokens"
    p = protocol.parse_completion({"model": "m", "prompt": "x", "max_tokens": 0, "echo": True})
    assert protocol.engine_request(p, [1], 16, 64)["max_tokens"] == 1  # the one token made is not answered


def test_chat_logprobs_fields():
    base = {"model": "m", "messages": []}
    assert protocol.parse_chat({**base, "logprobs": True}).logprobs == 0
    assert protocol.parse_chat({**base, "logprobs": True, "top_logprobs": 5}).logprobs == 5
    assert protocol.parse_chat({**base, "logprobs": False}).logprobs is None
    assert _param(protocol.parse_chat, {**base, "top_logprobs": 1}) == "top_logprobs"
    assert _param(protocol.parse_chat, {**base, "logprobs": True, "top_logprobs": 21}) == "top_logprobs"
    assert _param(protocol.parse_chat, {**base, "n": 5}, 4) == "n"


def test_response_format_and_prompts():
    schema = {"type": "object"}
    rf = {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}
    assert protocol.response_format(rf) == {"type": "json_schema", "schema": schema, "strict": False}
    assert protocol.response_format({"response_format": {"type": "text"}}) is None
    assert _param(protocol.response_format, {"response_format": {"type": "json_schema"}}) == "response_format"
    p = protocol.parse_completion({"model": "m", "prompt": ["a", [1, 2]]})
    assert protocol.prompts(p) == ["a", [1, 2]]
    assert protocol.prompts(protocol.parse_completion({"model": "m", "prompt": [1, 2]})) == [[1, 2]]
    assert _param(protocol.prompts, protocol.parse_completion({"model": "m", "prompt": []})) == "prompt"
    assert protocol.parse_completion({"model": "m", "prompt": "x", "frob": 1, "user": "u"}).unknown == ["frob"]


def test_unknown_fields_logged_once_or_refused(caplog):
    policy = FieldPolicy()
    with caplog.at_level(logging.WARNING, logger="computron.server"):
        for _ in range(3):
            assert policy.unknown({"a": 1, "zz": 2, "k": 3}, {"k"}, "chat") == ["a", "zz"]
    assert sorted(r.getMessage().split("'")[1] for r in caplog.records) == ["a", "zz"]
    assert _param(FieldPolicy(strict=True).unknown, {"a": 1, "k": 2}, {"k"}, "chat") == "a"
    assert _param(policy.unknown, {"b": 1}, set(), "chat", True) == "b"  # a model's strict_fields wins


# ---- chat messages and tools ---------------------------------------------------------------------------

def test_chat_messages_normalized_for_templates():
    msgs = chat.chat_messages([
        {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}])
    assert msgs == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "", "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
                    {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"}]
    assert _param(chat.chat_messages, [{"role": "user", "content": None}]) == "messages[0].content"
    assert _param(chat.chat_messages, [{"role": "user", "content": [{"type": "image_url"}]}]) == "messages[0].content"
    bad_args = [{"role": "assistant", "content": None,
                 "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{x"}}]}]
    assert _param(chat.chat_messages, bad_args) == "messages[0].tool_calls[0].function.arguments"


F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                  "properties": {"x": {"type": "integer"}}}}}
G = {"type": "function", "function": {"name": "g"}}


def test_tool_choice_and_the_forced_grammar():
    t = chat.parse_tools({"tools": [F, G]})
    assert (t.choice, t.parsed, t.forced, t.grammar()) == ("auto", True, False, None)
    assert chat.parse_tools({}).choice == "none" and chat.parse_tools({}).template_tools() is None
    assert chat.parse_tools({"tools": [F], "tool_choice": "none"}).template_tools() is None
    named = chat.parse_tools({"tools": [F, G], "tool_choice": {"type": "function", "function": {"name": "f"}}})
    assert named.grammar() == {"type": "json_schema", "schema": F["function"]["parameters"], "strict": True}
    assert chat.forced_calls('{"x": 3}', named)[0].name == "f"
    assert chat.forced_calls('{"x": 3', named) is None
    req = chat.parse_tools({"tools": [F, G], "tool_choice": "required", "parallel_tool_calls": False})
    schema = req.grammar()["schema"]
    assert schema["maxItems"] == 1 and [o["properties"]["name"]["enum"] for o in schema["items"]["anyOf"]] == \
        [["f"], ["g"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    calls = chat.forced_calls('[{"name": "g", "parameters": {}}, {"name": "f", "parameters": {"x": 1}}]', req)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("g", {}), ("f", {"x": 1})]
    assert _param(chat.parse_tools, {"tools": [F], "tool_choice": {"type": "function",
                                                                   "function": {"name": "h"}}}) == "tool_choice"
    assert _param(chat.parse_tools, {"tool_choice": "required"}) == "tool_choice"
    assert _param(chat.parse_tools, {"tools": [{"type": "retrieval"}]}) == "tools[0]"
    assert _param(chat.template_kwargs, {"chat_template_kwargs": {"tools": []}}) == "chat_template_kwargs"


# ---- tool-call parsers -------------------------------------------------------------------------------

def _stream(parser, text, step=1):
    s, events = parser.stream(), []
    for i in range(0, len(text), step):
        events += s.push(text[i:i + step])
    events += s.finish()
    return events


def _calls(events):
    return [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)]


HERMES = ('I will look.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
          '<tool_call>{"name": "g", "arguments": {}}</tool_call>')


@pytest.mark.parametrize("step", [1, 2, 7, 1000])
def test_hermes_parser_whole_and_streamed(step):
    p = tool_parsers.get_parser("hermes")
    content, calls = p.parse(HERMES)
    assert content == "I will look." and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}),
                                                                                               ("g", {})]
    events = _stream(p, HERMES, step)
    text = "".join(e for e in events if isinstance(e, str))
    assert text == "I will look." and "<" not in text and _calls(events) == [("f", {"x": 1}), ("g", {})]
    assert "".join(_stream(p, "a < b <tool", step)) == "a < b <tool"  # held back while it may begin a call


def test_hermes_parser_edge_cases():
    p = tool_parsers.get_parser("qwen")
    assert p.parse("no calls here") == ("no calls here", [])
    assert p.parse("<tool_call>{not json}</tool_call>") == ("<tool_call>{not json}</tool_call>", [])
    content, calls = p.parse('<tool_call>{"name": "f", "arguments": {"x": 2}}')  # ended before its closing tag
    assert content == "" and calls[0].name == "f"
    assert p.parse('<tool_call>{"name": "f", "arguments": "{\\"x\\": 3}"}</tool_call>')[1][0].arguments == '{"x": 3}'


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_llama3_json_parser_whole_and_streamed(step):
    p = tool_parsers.get_parser("llama3_json")
    one = '{"name": "f", "parameters": {"x": 1}}'
    assert _calls(p.parse(one)[1]) == [("f", {"x": 1})]
    assert _calls(_stream(p, "<|python_tag|>" + one + "; " + '{"name": "g", "parameters": {}}', step)) == \
        [("f", {"x": 1}), ("g", {})]
    assert "".join(_stream(p, "Just text {with braces}", step)) == "Just text {with braces}"
    assert _stream(p, '{"not": "a call"}', step) == ['{"not": "a call"}']


def test_parser_detection_from_the_chat_template():
    assert tool_parsers.detect("...<tool_call>\n{{ tool_call | tojson }}</tool_call>...") == "hermes"
    assert tool_parsers.detect("{{- '<|python_tag|>' }}") == "llama3_json"
    assert tool_parsers.detect("{{ messages }}") is None and tool_parsers.detect(None) is None
    with pytest.raises(ValueError, match="unknown tool_call_parser"):
        tool_parsers.get_parser("mistral")


# ---- logprob shapes --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LP:
    token: int
    logprob: float
    top: Tuple[Tuple[int, float], ...]


def test_logprob_shapes():
    tok = {1: "a", 2: "b", 3: "é"}.get
    lps = [None, LP(2, -0.5, ((3, -0.1), (2, -0.5))), LP(3, -0.1, ())]
    out = logprobs.completion_logprobs(tok, [1, 2, 3], lps, [0, 1, 2])
    assert out == {"tokens": ["a", "b", "é"], "token_logprobs": [None, -0.5, -0.1],
                   "top_logprobs": [None, {"é": -0.1, "b": -0.5}, {"é": -0.1}], "text_offset": [0, 1, 2]}
    content = logprobs.chat_content(tok, lps[1:])
    assert content[0] == {"token": "b", "logprob": -0.5, "bytes": [98], "top_logprobs": [
        {"token": "é", "logprob": -0.1, "bytes": [195, 169]}, {"token": "b", "logprob": -0.5, "bytes": [98]}]}
    assert logprobs.split(5) == ("token", 5) and logprobs.split(lps[1])[0] == "logprob"
    with pytest.raises(TypeError):
        logprobs.split("x")


# ---- the Responses API ------------------------------------------------------------------------------------

def test_responses_input_becomes_chat_messages():
    p, msgs, tools = responses.parse_responses({
        "model": "m", "instructions": "sys", "max_output_tokens": 7, "tool_choice": "auto", "store": False,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "text": {"format": {"type": "json_schema", "name": "o", "schema": {"type": "object"}, "strict": True}},
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                  {"type": "reasoning", "summary": []},
                  {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                  {"type": "function_call", "call_id": "c2", "name": "f", "arguments": '{"a": 1}'},
                  {"type": "function_call_output", "call_id": "c1", "output": "r1"},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}]})
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant"]
    assert [c["id"] for c in msgs[2]["tool_calls"]] == ["c1", "c2"] and msgs[3]["name"] == "f"
    assert p.max_tokens == 7 and p.grammar == {"type": "json_schema", "schema": {"type": "object"}, "strict": True}
    assert tools.tools[0]["function"]["name"] == "f" and p.unknown == []
    assert _param(responses.parse_responses, {"model": "m", "input": "x", "previous_response_id": "r"}) == \
        "previous_response_id"
    assert _param(responses.parse_responses, {"model": "m", "input": [{"type": "web_search_call"}]}) == \
        "input[0].type"
    assert _param(responses.parse_responses, {"model": "m", "input": "x", "tools": [{"type": "web_search"}]}) == \
        "tools[0]"


class _Run:
    n_prompt, n_generated = 4, 9

    def finish_reason(self):
        return "stop"


def test_responses_event_sequence_text_then_a_call():
    p, _, tools = responses.parse_responses({"model": "m", "input": "x", "tools": [
        {"type": "function", "name": "f", "parameters": {"type": "object"}}]})
    rb = responses.ResponseBuilder(p, {}, tools, tool_parsers.get_parser("hermes"), str)
    events = rb.start()
    for piece in ("Sure", ". <tool", '_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'):
        events += rb.feed(piece)
    events += rb.finish(_Run(), "")
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = events[-1]["response"]
    assert [o["type"] for o in done["output"]] == ["message", "function_call"]
    assert done["output"][0]["content"][0]["text"] == "Sure." and done["usage"]["total_tokens"] == 13
    assert [e.get("output_index") for e in events[2:-1]] == [0] * 7 + [1] * 4


def test_server_settings_and_cli_flag():
    from computron.server.cli import _parser
    from computron.server.config import ConfigError, parse_server
    s = parse_server({"strict_fields": True, "max_n": 4})
    assert (s.strict_fields, s.max_n) == (True, 4) and parse_server({}).max_n == 16
    for bad_value in ({"strict_fields": "yes"}, {"max_n": 0}):
        with pytest.raises(ConfigError, match=f"server.{next(iter(bad_value))}"):
            parse_server(bad_value)
    assert _parser().parse_args(["serve", "x", "--strict-fields"]).strict_fields is True
    assert _parser().parse_args(["serve", "x"]).strict_fields is None  # the config file's value stands
