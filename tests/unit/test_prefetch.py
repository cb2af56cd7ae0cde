"""The master's start-up read-ahead (``runtime/prefetch.py``): which checkpoint files it asks the kernel for."""
import os

from computron import ModelConfig, zoo
from computron.runtime.prefetch import prefetch_startup


def test_start_up_prefetch_asks_for_the_files_read_at_start_up(checkpoints, monkeypatch):
    """The master has the kernel read the checkpoints the workers read at start-up: every model's files in
    order while their bytes over the workers fit in host_budget; none in paper mode."""
    advised = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, a, n, advice: (
        advised.append((os.readlink(f"/proc/self/fd/{fd}"), advice)), real(fd, a, n, advice)))
    names = ["opt0", "opt1", "llama0"]
    configs = [ModelConfig(m, zoo.load_causal_lm, {"path": checkpoints[m]}) for m in names]
    configs.insert(1, ModelConfig("mlp", zoo.mlp))  # no checkpoint: nothing to read
    files = [os.path.join(checkpoints[m], "model.safetensors") for m in names]
    size = os.path.getsize(files[0])

    def asked(*args):
        advised.clear()
        thread = prefetch_startup(configs, *args)
        if thread is not None:
            thread.join(30)
        return [f for f, advice in advised if advice == os.POSIX_FADV_WILLNEED]
    assert asked(None, 2) == files
    assert asked(size, 2) == files[:2]  # half of each file per worker: two fit
    assert asked(size // 2 - 1, 2) == []
    assert asked(None, 2, True) == []
