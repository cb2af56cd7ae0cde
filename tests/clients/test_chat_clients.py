"""LangChain, instructor and openai-agents (in-process, ``chat_clients.py``) against ``computron serve`` with
SmolLM2-135M-Instruct: each runs to completion, nothing refused, and answers in the client's own types (an
AIMessage with tool calls or content, a pydantic object, the agent's final text).

What each sends (besides model, messages, temperature 0 and max_completion_tokens / max_tokens):
- LangChain ``bind_tools``: ``tools`` (OpenAI function tools), ``tool_choice`` {"type": "function", "function":
  {"name": ...}} when one tool is forced, ``stream: false``;
- LangChain ``with_structured_output``: ``response_format`` {"type": "json_schema", "json_schema": {"name",
  "schema", "strict": true}} (its default method), or with method="function_calling" ``tools`` + a named
  ``tool_choice`` + ``parallel_tool_calls: false``;
- LangChain's legacy ``OpenAI().batch``: one ``/v1/completions`` request, ``prompt`` a list of two strings, with
  ``logprobs: null``, ``n: 1``, ``seed: null``, ``presence_penalty`` / ``frequency_penalty`` 0, ``top_p`` 1;
- instructor TOOLS: ``tools`` + a named ``tool_choice``; JSON_SCHEMA: ``response_format`` {"type":
  "json_schema", "json_schema": {"name", "schema"}} (no ``strict``); JSON: ``response_format`` {"type":
  "json_object"} and the schema in a system message (only this one relies on the model to follow the schema);
- openai-agents: ``POST /v1/responses`` with ``input`` (a list of messages), ``instructions``,
  ``max_output_tokens``, ``tools: []``, ``include: []``.
"""
import pytest
from chat_clients import (Person, agents_run, instructor_extract, langchain_bind_tools, langchain_legacy_batch,
                          langchain_structured)
from client_helpers import run_client

TIMEOUT = 900  # the first test of a run also waits for the GGUF conversion (minutes on a busy machine)


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("tool_choice", [None, "get_weather"])
def test_langchain_bind_tools(proxy, tool_choice):
    from langchain_core.messages import AIMessage
    msg = run_client(proxy, f"LangChain bind_tools(tool_choice={tool_choice})",
                     lambda: langchain_bind_tools(proxy.url, tool_choice))
    assert isinstance(msg, AIMessage), msg
    assert msg.tool_calls or msg.content, msg
    assert all(c["name"] == "get_weather" and isinstance(c["args"], dict) for c in msg.tool_calls), msg.tool_calls
    if tool_choice:  # forced: the call is there, its arguments parsed
        assert len(msg.tool_calls) >= 1 and isinstance(msg.tool_calls[0]["args"].get("city"), str), msg.tool_calls
    body = proxy.requests("/v1/chat/completions")[0].body
    assert body["tools"][0]["function"]["name"] == "get_weather", body


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(proxy, method):
    person = run_client(proxy, f"LangChain with_structured_output(method={method!r})",
                        lambda: langchain_structured(proxy.url, method))
    assert isinstance(person, Person), person
    body = proxy.requests("/v1/chat/completions")[0].body
    assert ("response_format" in body) == (method == "json_schema"), body


@pytest.mark.timeout(TIMEOUT)
def test_langchain_legacy_completions_batch(proxy):
    texts = run_client(proxy, "LangChain OpenAI().batch", lambda: langchain_legacy_batch(proxy.url))
    assert isinstance(texts, list) and len(texts) == 2 and all(isinstance(t, str) for t in texts), texts
    assert [len(x.body["prompt"]) for x in proxy.requests("/v1/completions")] == [2]  # one request, two prompts


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA", "JSON"])
def test_instructor(proxy, mode):
    person = run_client(proxy, f"instructor Mode.{mode}", lambda: instructor_extract(proxy.url, mode))
    assert isinstance(person, Person), person


@pytest.mark.timeout(TIMEOUT)
def test_openai_agents_responses_api(proxy):
    result = run_client(proxy, "openai-agents Runner.run_sync (Responses API)", lambda: agents_run(proxy.url))
    assert isinstance(result.final_output, str) and result.final_output.strip(), result
    assert [x.path for x in proxy.requests() if x.method == "POST"] == ["/v1/responses"], proxy.requests()
