"""What the real-client tests share: the offline environment, the served model's id, ``run_client``."""
from client_proxy import RecordingProxy

OFFLINE = {
    "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",  # no hub, local files only
    "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1", "DISABLE_TELEMETRY": "1",
    "OPENAI_AGENTS_DISABLE_TRACING": "1",  # openai-agents' tracing exporter would post to OpenAI
    "LANGSMITH_TRACING": "false", "LANGCHAIN_TRACING_V2": "false",
    "OPENAI_API_KEY": "sk-local-test",  # the clients insist on a key; this server has none set
    "TOKENIZERS_PARALLELISM": "false",
}
MODEL = "smol"


def run_client(proxy: RecordingProxy, client: str, fn):
    """``fn()``, failing with the list of refused requests when the server refused any (also when the client
    then raised: its own error usually hides which field was refused)."""
    try:
        result = fn()
    except Exception as exc:
        if proxy.refused():  # the client's own traceback would only hide which field was refused
            first = (str(exc).splitlines() or [""])[0][:300]
            raise AssertionError(f"{proxy.refusals_message(client)}\n(the client then raised "
                                 f"{type(exc).__name__}: {first})") from None
        raise
    assert proxy.requests(), f"{client}: sent no request through the proxy"
    assert not proxy.refused(), proxy.refusals_message(client)
    return result
