"""Model builders and references shared by the tests (module-level, so workers can unpickle them),
``run_main`` for the scripts' CPU paths, and what a test needs to start a command (``free_port``,
``command_env``)."""
import os
import signal
import socket
import subprocess
import sys

import psutil
import torch

from computron import zoo

MLP_SIZES = (16, 32, 32, 16)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "COMPUTRON_LOG_LEVEL", "COMPUTRON_LOG_FILE", "RAY_ADDRESS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rest_of_output(proc, timeout: float):
    """``(stdout, stderr)``: all a process still writes, once some lines of its stdout were read (``readline``),
    and its end awaited within ``timeout``. Read through the same file objects: ``Popen.communicate`` reads
    the pipes' descriptors, so what a ``readline`` took into the file object's buffer beyond its line (output
    that arrived together with it) would be lost."""
    import threading
    err = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
    reader.start()
    out = proc.stdout.read()
    proc.wait(timeout)
    reader.join(timeout)
    return out, "".join(err)


def stop_command(proc, family, timeout: float, grace: float) -> list:
    """SIGTERM ``proc`` and wait ``timeout`` for it (then kill it); wait ``grace`` for the processes of
    ``family`` (psutil processes it started) and kill those still there. Returns those that had to be killed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    _, alive = psutil.wait_procs(family, timeout=grace)
    for p in alive:
        p.kill()
    return alive


def command_env(**extra) -> dict:
    """This environment for a command a test starts: the checkout importable, the venv's commands first on
    PATH, no launcher's rank variables or log settings inherited from whatever runs the tests."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    for k in _LAUNCH_VARS:
        env.pop(k, None)
    env.update(extra)
    return env


def multiprocessing_servers() -> set:
    """The pids of the processes multiprocessing keeps for the life of this one (its resource tracker, and
    the fork server workers start from): no test leaves them behind."""
    from multiprocessing import forkserver, resource_tracker
    return {getattr(resource_tracker._resource_tracker, "_pid", None),
            getattr(forkserver._forkserver, "_forkserver_pid", None)} - {None}


def is_multiprocessing_server(proc, parent_pid: int) -> bool:
    """Whether ``proc`` (psutil) is the resource tracker or fork server of the process ``parent_pid``."""
    cmd = " ".join(proc.cmdline())
    return proc.ppid() == parent_pid and ("resource_tracker" in cmd or "forkserver" in cmd)


def mlp(seed: int):
    return zoo.mlp(MLP_SIZES, seed=seed)


def run_main(path: str, *args: str, json_line: bool = True) -> tuple:
    """Run a script's ``main(argv)`` in this process, as its command line would, and return ``(stdout,
    stderr)``; with ``json_line`` the stdout must be one line of JSON, returned parsed.

    Why in this process: as a command, a benchmark's CPU path pays a second interpreter importing torch and
    a second fork server importing transformers' models, about 14 CPU seconds a script on 2 cores; here its
    engines fork from this process's warm fork server. The module is loaded under another name than
    ``"__main__"``, so only ``main`` runs (a script that prints from its ``__main__`` block stays a command);
    the ``sys.path`` it extends is restored after it."""
    import contextlib
    import importlib.util
    import io
    import json
    import sys
    name = "_script_" + os.path.splitext(os.path.basename(path))[0]
    saved_path, out, err = list(sys.path), io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            spec = importlib.util.spec_from_file_location(name, path)
            module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
            spec.loader.exec_module(module)
            module.main(list(args))
    except BaseException:
        sys.stderr.write(err.getvalue()[-4000:])
        raise
    finally:
        sys.path[:] = saved_path
    if not json_line:
        return out.getvalue(), err.getvalue()
    lines = out.getvalue().strip().splitlines()
    assert len(lines) == 1, out.getvalue()[-2000:]
    return json.loads(lines[0]), err.getvalue()


def env_scale():
    """Multiplies its 4 inputs by ``COMPUTRON_TEST_SCALE`` as the worker building it sees that variable."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4) * float(os.environ["COMPUTRON_TEST_SCALE"]))
    return model


def failing_model_fn():
    raise RuntimeError("model_fn exploded on purpose")


class Picky(torch.nn.Module):
    """Raises on negative inputs: a forward that fails for some batches only."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((4,), 2.0))

    def forward(self, x):
        if (x < 0).any():
            raise ValueError("negative input is not allowed")
        return x * self.scale


def picky():
    return Picky()


def big_mlp(width: int = 4096, depth: int = 6):
    """About width*width*4*depth bytes: a load that takes a while on CPU."""
    return zoo.mlp((width,) * (depth + 1), seed=0)


def greedy_reference(path_or_model, prompt, max_tokens):
    """The unsharded transformers model's greedy continuation, cut after its first EOS."""
    model = zoo.load_causal_lm(path_or_model) if isinstance(path_or_model, str) else path_or_model
    return zoo.reference_generate(model, prompt, max_tokens)


POISON_TOKEN = 13


class _PoisonEmbedding(torch.nn.Embedding):
    """An embedding that raises when it sees POISON_TOKEN: a step that fails on a worker."""

    def forward(self, ids):
        if (ids == POISON_TOKEN).any():
            raise ValueError(f"token {POISON_TOKEN} is poison")
        return super().forward(ids)


def poisoned_lm(path):
    model = zoo.load_causal_lm(path)
    model.model.decoder.embed_tokens.__class__ = _PoisonEmbedding
    return model


HANG_TOKEN = 14


class _HangingEmbedding(torch.nn.Embedding):
    """An embedding that never returns when it sees HANG_TOKEN: a forward stuck forever."""

    def forward(self, ids):
        if (ids == HANG_TOKEN).any():
            import threading
            threading.Event().wait()
        return super().forward(ids)


def hanging_lm(path):
    model = zoo.load_causal_lm(path)
    model.model.decoder.embed_tokens.__class__ = _HangingEmbedding
    return model


def write_tiny_llama_gguf(path, seed: int = 0) -> str:
    """A GGUF file transformers reads as a tiny Llama (2 layers, hidden 16, 2 heads / 1 KV head, float32
    random weights) with a 64-token byte-free vocabulary and a ChatML template: a real conversion in seconds."""
    import gguf
    import numpy as np
    rng = np.random.default_rng(seed)
    vocab, hidden, layers, ffn, heads, kv = 64, 16, 2, 32, 2, 1
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(ord("A"), ord("A") + vocab - 3)]
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_token_scores([0.0] * vocab)
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

    def f(*shape):
        return (rng.standard_normal(shape) * 0.3).astype(np.float32)
    w.add_tensor("token_embd.weight", f(vocab, hidden))
    for i in range(layers):
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (hidden // heads * kv, hidden)),
                            ("attn_v", (hidden // heads * kv, hidden)), ("attn_output", (hidden, hidden)),
                            ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))):
            w.add_tensor(f"blk.{i}.{name}.weight", f(*shape))
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


class _LatePoisonEmbedding(torch.nn.Embedding):
    """An embedding that raises at its ``poison_at``-th forward of a single token (a decode step of one
    sequence), once: a decode step that fails on a worker, with the model fine before and after."""

    def forward(self, ids):
        if ids.numel() == 1:
            self.decodes = getattr(self, "decodes", 0) + 1
            if self.decodes == self.poison_at:
                raise ValueError(f"decode {self.poison_at} is poison")
        return super().forward(ids)


def late_poisoned_lm(path, poison_at: int = 4):
    model = zoo.load_causal_lm(path)
    emb = model.get_input_embeddings()
    emb.__class__ = _LatePoisonEmbedding
    emb.poison_at = poison_at
    return model
