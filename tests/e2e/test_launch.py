"""Launch modes and process hygiene: torchrun / colossalai run attach mode, SIGTERM, no leftovers."""
import os
import re
import shutil
import signal
import subprocess
import sys

import psutil
import pytest
from helpers import command_env, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(300)


def _check_mlp_output(out: str, n: int):
    errs = [float(e) for e in re.findall(r"max \|sharded - unsharded\| = (\S+)", out)]
    assert len(errs) == n, out
    assert max(errs) < 1e-5, out


def _run(cmd):
    proc = subprocess.run(cmd, cwd=ROOT, env=command_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_attach_mode_under_torchrun():
    out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_port", str(free_port()), "examples/mlp/serve_mlp.py", "--tp", "2",
                "--width", "64", "--requests", "4"])
    _check_mlp_output(out, 4)


@pytest.mark.skipif(shutil.which("colossalai", path=os.path.dirname(sys.executable)) is None,
                    reason="colossalai is not installed (make setup installs it)")
def test_attach_mode_under_colossalai_run():
    colossalai = shutil.which("colossalai", path=os.path.dirname(sys.executable))
    out = _run([colossalai, "run", "--nproc_per_node", "2", "--master_port", str(free_port()),
                "examples/mlp/serve_mlp.py", "--pp", "2", "--width", "64", "--requests", "4"])
    _check_mlp_output(out, 4)


def _default_sigint():
    """In the child before it runs: SIGINT's default disposition, whatever pytest was started with (a shell
    starts background jobs with SIGINT ignored, and an ignored SIGINT is inherited and kept by Python)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_shuts_down_without_leftovers(sig):
    proc = subprocess.Popen([sys.executable, "examples/echo/serve_echo.py", "--serve", "--tp", "2"], cwd=ROOT,
                            env=command_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_default_sigint)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "READY", line + proc.stderr.read()
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 2  # the workers (and multiprocessing's resource tracker)
        proc.send_signal(sig)
        proc.wait(timeout=60)
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"left behind: {[p.pid for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


ATTACH_FAILURE = """
import sys
from helpers import failing_model_fn
from computron import EngineConfig, LaunchEngine, LaunchError, ModelConfig
if __name__ == "__main__":
    try:
        LaunchEngine(EngineConfig(start_timeout_s=60), [ModelConfig("bad", failing_model_fn)], 2, 1)
    except LaunchError as exc:
        # one write: both ranks share the pipe, and print's separate writes can interleave
        sys.stdout.write(f"LAUNCH ERROR {'model_fn exploded on purpose' in str(exc)}\\n")
        sys.stdout.flush()
"""


def test_attach_mode_start_failure_reaches_every_rank(tmp_path):
    script = tmp_path / "attach_failure.py"
    script.write_text(ATTACH_FAILURE)
    env = command_env()
    env["PYTHONPATH"] = os.path.join(ROOT, "tests") + os.pathsep + env["PYTHONPATH"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), str(script)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("LAUNCH ERROR True") == 2, proc.stdout + proc.stderr


@pytest.mark.parametrize("last", [0, 1], ids=["rank0-built-last", "rank1-built-last"])
def test_attach_mode_start_up_order_does_not_matter(tmp_path, last):
    """Heartbeats that reach rank 0's master before its engine exists are handed over, not lost."""
    fifo = tmp_path / "handoff"
    os.mkfifo(fifo)
    env = command_env()
    env.update(LAST=str(last), HANDOFF=str(fifo))
    env["PYTHONPATH"] = os.path.join(ROOT, "tests") + os.pathsep + env["PYTHONPATH"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(free_port()), os.path.join(ROOT, "tests", "e2e", "attach_race.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ATTACH RACE OK" in proc.stdout, proc.stdout + proc.stderr
    assert "KeyError" not in proc.stderr and "engine is dead" not in proc.stderr, proc.stderr


LABELLED_TRACEBACK = """
from computron import EngineConfig, LaunchEngine, ModelConfig, zoo
if __name__ == "__main__":
    engine = LaunchEngine(EngineConfig(), [ModelConfig("m", zoo.mlp, {"sizes": (4, 4), "seed": 0})], 1, 1)
    engine.close()
    raise RuntimeError("the user's own error")
"""


def test_the_users_tracebacks_are_not_labelled_with_a_rank(tmp_path):
    """Spawn mode makes the caller's process a rank of the group; its tracebacks stay the user's own."""
    script = tmp_path / "labelled.py"
    script.write_text(LABELLED_TRACEBACK)
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=command_env(), capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 1, proc.stderr
    tail = proc.stderr[proc.stderr.index("Traceback"):]
    assert "RuntimeError: the user's own error" in tail and "[rank" not in tail, tail
