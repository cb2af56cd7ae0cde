"""Shared fixtures: tiny local checkpoints (never the hub) and a no-leaked-process check."""
import os

import psutil
import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """Tiny OPT (seeds 0-2) and Llama (seed 0) checkpoints saved with save_pretrained."""
    from computron import zoo
    root = tmp_path_factory.mktemp("ckpt")
    paths = {f"opt{s}": zoo.save_random_causal_lm("opt-tiny", str(root / f"opt{s}"), seed=s) for s in range(3)}
    paths["llama0"] = zoo.save_random_causal_lm("llama-tiny", str(root / "llama0"), seed=0)
    return paths


@pytest.fixture(autouse=True)
def no_leaked_processes():
    """Every test must leave no child process behind."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    from multiprocessing import resource_tracker
    tracker = getattr(resource_tracker._resource_tracker, "_pid", None)  # lives as long as pytest
    extra = [p for p in me.children(recursive=True) if p.pid not in before and p.pid != tracker]
    _, alive = psutil.wait_procs(extra, timeout=15)
    for p in alive:
        p.kill()
    assert not alive, f"test left processes behind: {[p.pid for p in alive]}"

