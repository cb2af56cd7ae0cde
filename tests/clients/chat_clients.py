"""The chat clients' calls the tests make, each a function of the server's base URL (no /v1) returning what the
client returned: LangChain's ``ChatOpenAI.bind_tools`` and ``with_structured_output`` and its legacy completion
model's ``batch``, instructor in its tools and JSON modes, and openai-agents' ``Runner.run_sync`` over the
Responses API. Greedy, short answers; no retries (a refused request fails at once); tracing off."""
from typing import List

from pydantic import BaseModel

from client_helpers import MODEL, OFFLINE

TIMEOUT_S = 240
PERSON_PROMPT = "Extract the person from this sentence: Alice is 31 years old."
WEATHER_PROMPT = "What is the weather like in Paris today?"


class Person(BaseModel):
    name: str
    age: int


def _key() -> str:
    return OFFLINE["OPENAI_API_KEY"]


def _chat_model(base: str, max_tokens: int):
    from langchain_openai import ChatOpenAI
    return ChatOpenAI(model=MODEL, base_url=f"{base}/v1", api_key=_key(), temperature=0, max_tokens=max_tokens,
                      timeout=TIMEOUT_S, max_retries=0)


def _weather_tool():
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return f"It is sunny in {city}."
    return get_weather


def langchain_bind_tools(base: str, tool_choice=None):
    """``ChatOpenAI(...).bind_tools([get_weather], tool_choice=...).invoke(question)``: an AIMessage."""
    llm = _chat_model(base, 64).bind_tools([_weather_tool()], **({"tool_choice": tool_choice} if tool_choice else {}))
    return llm.invoke(WEATHER_PROMPT)


def langchain_structured(base: str, method: str):
    """``ChatOpenAI(...).with_structured_output(Person, method=method).invoke(...)``: a Person."""
    return _chat_model(base, 64).with_structured_output(Person, method=method).invoke(PERSON_PROMPT)


def langchain_legacy_batch(base: str) -> List[str]:
    """LangChain's completion model (``langchain_openai.OpenAI``): ``batch`` sends the prompts in one request."""
    from langchain_openai import OpenAI
    llm = OpenAI(model=MODEL, base_url=f"{base}/v1", api_key=_key(), temperature=0, max_tokens=8,
                 timeout=TIMEOUT_S, max_retries=0)
    return llm.batch(["The capital of France is", "One, two, three,"])


def instructor_extract(base: str, mode: str) -> Person:
    """``instructor.from_openai(OpenAI(...), mode=Mode[mode]).chat.completions.create(response_model=Person)``."""
    import instructor
    from openai import OpenAI
    client = instructor.from_openai(OpenAI(base_url=f"{base}/v1", api_key=_key(), timeout=TIMEOUT_S, max_retries=0),
                                    mode=instructor.Mode[mode])
    return client.chat.completions.create(model=MODEL, response_model=Person, max_retries=1, max_tokens=64,
                                          temperature=0, messages=[{"role": "user", "content": PERSON_PROMPT}])


def agents_run(base: str):
    """openai-agents: one agent on ``OpenAIResponsesModel`` (``POST /v1/responses``), ``Runner.run_sync``;
    tracing disabled (its exporter would post to OpenAI)."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, set_tracing_disabled
    from openai import AsyncOpenAI
    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"{base}/v1", api_key=_key(), timeout=TIMEOUT_S, max_retries=0)
    agent = Agent(name="assistant", instructions="Answer in one short sentence.",
                  model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(max_tokens=32, temperature=0))
    return Runner.run_sync(agent, "What is the capital of France?", max_turns=2,
                           run_config=RunConfig(tracing_disabled=True))
