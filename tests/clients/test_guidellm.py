"""guidellm's synthetic benchmark (its command line: its Python entry point takes a whole scenario object and is
not meant to be stable) against ``computron serve``: a few synthetic requests, one at a time, streamed, through
its default request format (``/v1/chat/completions``) and through ``/v1/completions``.

What guidellm sends: ``GET /health``, then per request ``{"model", "stream": true, "stream_options":
{"include_usage": true, "continuous_usage_stats": true}, "max_completion_tokens" (chat) or "max_tokens": N,
"ignore_eos": true, "messages": [{"role": "user", "content": [{"type": "text", "text": ...}]}] or "prompt"}``;
with ``ignore_eos`` every answer has exactly N tokens, which the report's token counts show (from ``usage``).
Offline: the synthetic prompts are made with the converted checkpoint's tokenizer (a local directory)."""
import json
import os
import signal
import subprocess
import sys

import pytest
from client_helpers import MODEL, OFFLINE, run_client
from helpers import command_env

REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 3, 16, 4


def run_guidellm(args, timeout):
    """guidellm's command in a session of its own (it starts worker processes): killed whole on a timeout."""
    proc = subprocess.Popen([sys.executable, "-m", "guidellm", *args], env=command_env(**OFFLINE),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"guidellm did not finish within {timeout}s:\n{out[-4000:]}") from None
    return proc.returncode, out


@pytest.mark.timeout(900)  # the first test of a run also waits for the GGUF conversion
@pytest.mark.parametrize("request_format", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_synthetic_benchmark(smol, proxy, tmp_path, request_format):
    _, tokenizer_dir = smol
    report = tmp_path / "report.json"
    args = ["run", "--backend", f"kind=openai_http,target={proxy.url},model={MODEL},request_format={request_format}",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
            "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
            "--profile", "kind=synchronous", "--constraint", f"kind=max_requests,count={REQUESTS}",
            "--output", f"kind=json,path={report}", "--disable-console-interactive"]
    code, out = run_client(proxy, f"guidellm run ({request_format})", lambda: run_guidellm(args, timeout=500))
    assert code == 0, out[-4000:]
    bench = json.loads(report.read_text())["benchmarks"]
    assert len(bench) == 1, out[-4000:]
    totals = bench[0]["metrics"]["request_totals"]
    # every request counted succeeded; on a busy machine guidellm 0.8.1 may end a max_requests run before it
    # counts the last answer (seen once: 3 answered 200, 2 counted, none errored or incomplete)
    ok = totals["successful"]
    assert REQUESTS - 1 <= ok <= REQUESTS and totals == {"successful": ok, "errored": 0, "incomplete": 0,
                                                         "total": ok}, totals
    produced = bench[0]["metrics"]["output_token_count"]["successful"]
    assert produced["count"] == ok and produced["total_sum"] == ok * OUTPUT_TOKENS, produced  # ignore_eos
    sent = proxy.requests(request_format)
    assert len(sent) == REQUESTS and all(x.status == 200 and x.body.get("ignore_eos") is True for x in sent), \
        [(x.status, x.body) for x in sent]
