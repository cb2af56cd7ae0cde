"""A newcomer's first hour: the README snippet runs as written, mistakes fail before any worker starts
as one line naming the model and the field or path, logs reach the console, the tools run."""
import json
import os
import re
import subprocess
import sys

import pytest
from helpers import command_env, free_port

from computron import EngineConfig, LaunchEngine, LaunchError, ModelConfig, zoo
from computron.preflight import PreflightError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV_BIN = os.path.dirname(sys.executable)
STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} ", re.M)  # wall-clock log timestamps


def readme_snippet() -> str:
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("## The API in ten lines"):]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "README: no python block under 'The API in ten lines'"
    return m.group(1)


def _check_snippet_output(proc):
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    answers = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
    assert len(answers) == 1, out  # printed once, by the master only
    ids = json.loads(answers[0][:answers[0].index("]") + 1])
    assert len(ids) >= 1 and all(isinstance(i, int) for i in ids), out
    assert "'opt1': 'loaded'" in answers[0], out
    # the workers' INFO start-up lines reach the console without log_dir, with wall-clock times
    assert re.search(r"rank1 computron\.worker INFO: rank 1 built opt2", proc.stderr), out
    assert STAMP.search(proc.stderr), out
    assert "alltoall" not in out and "Writing model shards" not in out and "Loading weights" not in out, out


@pytest.mark.timeout(240)
def test_readme_snippet_spawn_and_torchrun(tmp_path):
    """The README's API snippet, verbatim: spawn mode (python), then attach mode (torchrun, 2 processes)."""
    script = tmp_path / "snippet.py"
    script.write_text(readme_snippet())
    master_log = tmp_path / "logs" / "master.log"
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path,
                          env=command_env(COMPUTRON_LOG_FILE=str(master_log)), capture_output=True, text=True,
                          timeout=150)
    _check_snippet_output(proc)
    assert re.search(r"master computron\.launch INFO: worker rank 1 ready", proc.stderr), proc.stderr
    assert STAMP.search(master_log.read_text()) and "worker rank 0 ready" in master_log.read_text()
    assert (tmp_path / "ckpt" / "opt2" / "config.json").is_file()
    proc = subprocess.run([os.path.join(VENV_BIN, "torchrun"), "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(script)], cwd=tmp_path, env=command_env(OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=150)
    _check_snippet_output(proc)


def gpt2_tiny():
    """A GPT-2 causal LM built by a user's model_fn: not a family the engine can shard."""
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32,
                                      bos_token_id=0, eos_token_id=0))


@pytest.mark.timeout(120)
def test_unsupported_causal_lm_from_model_fn_fails_the_launch():
    with pytest.raises(LaunchError, match=r"model 'g': GPT2LMHeadModel \('gpt2'\) is a causal LM the engine "
                                          r"cannot shard \(supported: model_type .*llama.*opt.* and any transformers "
                                          r"decoder whose config declares base_model_pp_plan\)"):
        engine = LaunchEngine(EngineConfig(start_timeout_s=100), [ModelConfig("g", gpt2_tiny)])
        engine.close()  # not reached when the launch fails as it should


# ---- the tools ---------------------------------------------------------------------------------

@pytest.mark.timeout(200)
def test_swap_benchmark_with_an_opt_model():
    """benchmarks/swap.py --model NAME: the path benchmarks/gpu_check.sh takes on a GPU."""
    proc = subprocess.run([sys.executable, "benchmarks/swap.py", "--model", "opt-tiny", "--repeats", "1",
                           "--modes", "fast"], cwd=ROOT, env=command_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["model"] == "opt-tiny" and out["load_s"] > 0 and out["ttfo_s"] > 0, out


@pytest.mark.timeout(200)
def test_launch_sh_colossalai_without_venv_on_path(tmp_path):
    """examples/opt/launch.sh puts the venv first on PATH (colossalai starts `torchrun` from PATH);
    the demo's request lines say which models each request loaded and evicted."""
    if not os.path.exists(os.path.join(VENV_BIN, "colossalai")):
        pytest.skip("colossalai is not installed (make setup installs it)")
    env = command_env(PATH="/usr/bin:/bin", MASTER_PORT=str(free_port()))
    proc = subprocess.run(["bash", "examples/opt/launch.sh", "colossalai", "2", "--tp", "2", "--requests", "3",
                           "--max-tokens", "2", "--ckpt-dir", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "torchrun: command not found" not in out
    assert re.search(r"\[  0\] opt0: .*<- swap: loaded opt0", out), out[-4000:]
    assert re.search(r"\[  1\] opt1: .*<- swap: evicted opt0, loaded opt1", out), out[-4000:]
    assert "random (seeded)" in out and "warm-up" in out
    assert os.path.isdir(tmp_path / "opt-tiny-float32-seed0")


def test_launch_inside_a_running_loop_warns(caplog):
    """LaunchEngine blocks for the whole start-up: called straight from a coroutine, it says so (and the
    preflight error still comes first, so nothing starts here)."""
    import asyncio

    async def main():
        with pytest.raises(PreflightError):
            LaunchEngine(EngineConfig(), [ModelConfig("lam", lambda: zoo.mlp())])
    with caplog.at_level("WARNING", logger="computron"):
        asyncio.run(main())
    assert any("asyncio.to_thread(LaunchEngine" in r.getMessage() for r in caplog.records), caplog.text


@pytest.mark.timeout(120)
def test_cli_help_imports_neither_torch_nor_transformers():
    """`computron --help` answers at once: the CLI's import path is lazy (checking a config against the
    family table included), and the package's names still import on first use."""
    check = ("import sys, computron, computron.server, computron.server.cli; "
             "from computron.server.config import encoder_model_types; assert 'vit' in encoder_model_types(); "
             "heavy = [m for m in ('torch', 'transformers', 'fastapi') if m in sys.modules]; "
             "assert not heavy, heavy; assert computron.__version__; "
             "from computron import LaunchEngine, EngineConfig, PayloadError; "
             "from computron.server import create_app; assert 'torch' in sys.modules")
    proc = subprocess.run([sys.executable, "-c", check], cwd=ROOT, env=command_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    cmds = [[sys.executable, "-m", "computron", "--help"], [sys.executable, "-m", "computron", "serve", "--help"]]
    script = os.path.join(VENV_BIN, "computron")  # the console script `make setup` installs
    if os.path.exists(script):
        cmds.append([script, "--help"])
    for cmd in cmds:
        proc = subprocess.run(cmd, cwd=ROOT, env=command_env(), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and "exit status" in proc.stdout.lower(), (cmd, proc.stdout, proc.stderr)


@pytest.mark.timeout(600)
def test_make_demo_answers_paris_and_says_how_to_keep_serving(tmp_path, smollm2_gguf, gguf_cache):
    """`make demo`'s script, as it runs it (PP=2, one resident model): SmolLM2's GGUF answers the factual
    question first, and correctly; every other answer, the swaps from /metrics, the PP note, how to keep the
    server up, and a clean exit of the server. (The GGUF conversion cache is the run's: converted once.)"""
    proc = subprocess.run([sys.executable, "examples/serve/demo.py", "--pp", "2", "--max-loaded", "1",
                           "--ckpt-dir", str(tmp_path)], cwd=ROOT, env=command_env(), capture_output=True, text=True,
                          timeout=540)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    first = re.search(r"^\[(\w+)\] (.*)$", out, re.M)  # the first answer printed
    assert first and first.group(1) == "smol", out
    assert first.group(2).startswith("streamed chat: 'What is the capital of France?' -> ") and \
        "Paris" in first.group(2), out
    assert re.search(r"^\[smol\] chat: 'Name three primary colors.' -> '.+'", out, re.M), out
    assert out.count("] completion (") == 2 and "[gamma] streamed chat:" in out and "[alpha] chat, sampled" in out
    loads = re.findall(r"^\s+(smol|alpha|beta|gamma)\s+load\s+(\d+)\s+(\d+\.\d+)", out, re.M)
    assert {m for m, _, _ in loads} == {"smol", "alpha", "beta", "gamma"}, out
    assert dict((m, int(n)) for m, n, _ in loads)["smol"] == 2, out  # loaded, evicted, loaded again
    assert "PP=2:" in out and "--keep-serving" in out, out
    assert "server exited with code 0" in out, out
    # a clean exit: no traceback (a SIGTERM'd server), no "nanobind: leaked ..." at an interpreter's teardown
    noise = [ln for ln in (out + proc.stderr).splitlines() if "Traceback" in ln or "leaked" in ln]
    assert not noise, "\n".join(noise[:20])
