"""Mistakes a newcomer makes fail before any worker starts, as one line naming the model and the field or
path (``preflight.py``); a checkpoint's dtype is kept. No process is started here."""
import json
import re
import socket
import threading

import psutil
import pytest
import torch

from computron import EngineConfig, LaunchEngine, LaunchError, ModelConfig, zoo
from computron.preflight import PreflightError


def _launch_fails(configs, match, tp=1, pp=1, **engine_kw):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(PreflightError) as err:
        LaunchEngine(EngineConfig(**engine_kw), configs, tp_world_size=tp, pp_world_size=pp)
    msg = str(err.value)
    assert "\n" not in msg, msg
    assert re.search(match, msg), msg
    assert isinstance(err.value, LaunchError) and isinstance(err.value, ValueError)
    started = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not started, "a worker started before the configuration was checked"
    return msg


def test_preflight_checkpoint_paths(tmp_path, checkpoints):
    missing = str(tmp_path / "no-such-ckpt")
    _launch_fails([ModelConfig("opt0", zoo.load_causal_lm, {"path": checkpoints["opt0"]}),
                   ModelConfig("lost", zoo.load_causal_lm, {"path": missing})],
                  rf"model 'lost': checkpoint directory model_kwargs\['path'\]='{re.escape(missing)}' does not exist")
    afile = tmp_path / "weights.bin"
    afile.write_bytes(b"x")
    _launch_fails([ModelConfig("f", zoo.load_causal_lm, {"path": str(afile)})], r"model 'f': .* is a file")
    (tmp_path / "empty").mkdir()
    _launch_fails([ModelConfig("e", zoo.load_causal_lm, {"path": str(tmp_path / "empty")})],
                  r"model 'e': .*has no config\.json")
    from transformers import AutoModelForCausalLM
    _launch_fails([ModelConfig("hf", AutoModelForCausalLM.from_pretrained,
                               {"pretrained_model_name_or_path": missing})],
                  r"model 'hf': .*pretrained_model_name_or_path.*does not exist")
    # and the loader itself, called directly: the path, not a Hub error
    with pytest.raises(FileNotFoundError, match=re.escape(missing)):
        zoo.load_causal_lm(missing)


def test_preflight_unsupported_architecture(tmp_path):
    ckpt = tmp_path / "gpt2"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_head": 4, "n_layer": 2}))
    msg = _launch_fails([ModelConfig("gpt", zoo.load_causal_lm, {"path": str(ckpt)})],
                        r"model 'gpt': checkpoint .* is a 'gpt2' causal LM, which the engine cannot shard")
    assert "opt" in msg and "llama" in msg and "generic module" in msg


def test_preflight_shapes(checkpoints):
    ckpt = {"path": checkpoints["opt0"]}  # opt-tiny: 4 heads, hidden 64, 4 layers
    _launch_fails([ModelConfig("opt0", zoo.load_causal_lm, ckpt)],
                  r"model 'opt0': checkpoint .* has num_attention_heads=4, not divisible by tp_world_size=3", tp=3)
    _launch_fails([ModelConfig("opt0", zoo.load_causal_lm, ckpt)],
                  r"model 'opt0': .* num_hidden_layers=4, fewer than pp_world_size=8", pp=8)
    from computron import CausalLMBatchManager
    _launch_fails([ModelConfig("opt0", zoo.load_causal_lm, ckpt,
                               batch_manager=CausalLMBatchManager.for_config(zoo.hf_config("opt-125m")))],
                  r"model 'opt0': ModelConfig\.batch_manager\.vocab_size=50272 exceeds the checkpoint .*"
                  r"vocab_size=512")
    _launch_fails([ModelConfig("opt0", zoo.load_causal_lm, dict(ckpt, dtype="fp16"))],
                  r"model 'opt0': model_kwargs\['dtype'\]='fp16': must be one of")
    # 4 query heads over 2 KV heads: TP=4 keeps each KV head on two ranks; TP=3 splits neither
    _launch_fails([ModelConfig("r", zoo.random_causal_lm, {"name": "llama-tiny"})],
                  r"model 'r': shape 'llama-tiny' has 4 attention heads, 2 KV heads and intermediate_size=\d+, which "
                  r"tp_world_size=3 cannot split; TP sizes that work: 1, 2, 4", tp=3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_preflight_cuda_absent():
    _launch_fails([ModelConfig("m", zoo.mlp)], r"EngineConfig\.device='cuda', but torch finds no CUDA device",
                  device="cuda")


def test_preflight_port_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        _launch_fails([ModelConfig("m", zoo.mlp)],
                      rf"EngineConfig\.master_port={port}: already in use .*master_port=0 for a free one",
                      master_port=port)


def test_served_port_turns_nagle_off_on_each_connection():
    """asyncio sets TCP_NODELAY on a connection accepted from ``reserve_port``'s socket: without it a
    streamed answer's first chunk waited for the client's delayed ACK on a kept-alive connection."""
    import asyncio

    from computron.preflight import reserve_port

    async def accepted_nodelay() -> int:
        sock = reserve_port("127.0.0.1", 0)
        seen = asyncio.get_running_loop().create_future()

        def on_client(reader, writer):
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_client, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            flag = await asyncio.wait_for(seen, 30)
            writer.close()
        return flag

    assert asyncio.run(accepted_nodelay()) != 0


def test_preflight_unpicklable():
    _launch_fails([ModelConfig("lam", lambda: zoo.mlp())],
                  r"model 'lam': ModelConfig\.model_fn \(.*<lambda>\) cannot be pickled.*not a lambda")
    _launch_fails([ModelConfig("kw", zoo.mlp, {"sizes": (4, 4), "seed": threading.Lock()})],
                  r"model 'kw': ModelConfig\.model_kwargs\['seed'\] \(lock\) cannot be pickled")


# ---- dtype -------------------------------------------------------------------------------------

def test_checkpoint_dtype_is_honoured(tmp_path):
    path = zoo.save_random_causal_lm("opt-tiny", str(tmp_path / "c"), dtype="float16")
    assert zoo.checkpoint_dtype(path) == "float16"
    assert zoo.save_random_causal_lm("opt-tiny", path, dtype="float16") == path  # kept
    with pytest.raises(ValueError, match=r"already holds float16 weights, not dtype='float32'"):
        zoo.save_random_causal_lm("opt-tiny", path, dtype="float32")
    assert next(zoo.load_causal_lm(path, dtype="float32").parameters()).dtype == torch.float32
    assert next(zoo.load_causal_lm(path).parameters()).dtype == torch.float16


