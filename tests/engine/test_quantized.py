"""Quantize-at-load (``ModelConfig.quantization``): packed weights parked, swapped and computed on every layout.

Each layout (TP=1, TP=2, PP=2) serves the family tests' tiny Llama three times from one checkpoint: as
int4 (groups of 32) expanded on arrival, as int8 computed packed (torch's int8 matmul), and as float, with
one model resident at a time, so quantized and float models swap in and out of the same device between
requests. Every answer equals the greedy continuation of the unsharded transformers model whose Linears
hold the same quantized weights dequantized (``formats.quantize`` then ``dequantize``, per whole weight):
TP and PP cut the packs without changing a weight.
"""
import asyncio

import pytest
import torch
from family_configs import llama
from helpers import greedy_reference

from computron import EngineConfig, LaunchEngine, ModelConfig, zoo
from computron.quant.formats import parse_quantization, quantize

MAX_TOKENS = 10
PROMPTS = ([5, 17, 33, 9], [100, 7, 250, 31, 64, 3, 12])
MODELS = {"int4": ("int4", "expand"), "int8": ("int8", "packed"), "float": (None, None)}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return llama(str(tmp_path_factory.mktemp("quant")))


def _reference(path: str, quantization):
    """The unsharded model with its decoder layers' Linear weights quantized and dequantized."""
    model = zoo.load_causal_lm(path)
    fmt = parse_quantization(quantization)
    if fmt is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                for mod in layer.modules():
                    if isinstance(mod, torch.nn.Linear):
                        n_in = mod.weight.shape[1]
                        mod.weight.copy_(fmt.dequantize(quantize(mod.weight, fmt), n_in))
    return model


def _configs(path):
    return [ModelConfig(m, zoo.load_causal_lm, {"path": path}, checkpoint=path, quantization=q, quant_compute=c)
            for m, (q, c) in MODELS.items()]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "pp2"])
def test_quantized_models_match_their_dequantized_reference(ckpt, tp, pp):
    refs = {m: [greedy_reference(_reference(ckpt, q), p, MAX_TOKENS).tolist() for p in PROMPTS]
            for m, (q, _) in MODELS.items()}
    assert refs["int4"] != refs["float"]  # the quantization shows in the answers: the comparison can fail

    async def go():
        engine = LaunchEngine(EngineConfig(max_loaded=1, max_batch_size=4), _configs(ckpt), tp, pp)
        async with engine:
            host = engine.workers[0].host_bytes
            assert host["int4"] < host["int8"] < host["float"], host
            need = engine.workers[0].device_need  # what the device budget counts beside the packed shard
            assert host["int4"] < need["int4"] and host["int8"] < need["int8"] and "float" not in need, need
            for _ in range(2):  # each model loaded twice, between the others
                for m in MODELS:
                    outs = await asyncio.gather(*[engine.submit(m, {"input_ids": p, "max_tokens": MAX_TOKENS})
                                                  for p in PROMPTS])
                    assert [o.tolist() for o in outs] == refs[m], f"{m} at tp={tp} pp={pp}"
                    snap = engine.snapshot().models[m]
                    assert snap.weight_format == {"int4": "int4-g32", "int8": "int8", "float": "float32"}[m]
                    assert snap.host_bytes == max(w.host_bytes[m] for w in engine.workers.values())
                    assert snap.device_bytes >= snap.host_bytes  # resident: the shard (+ what it expanded)
                    assert snap.last_load["bytes"] == sum(w.host_bytes[m] for w in engine.workers.values())
            loads = [r.model_id for r in engine.metrics("load")]
            assert loads.count("int4") >= 2 and loads.count("float") >= 2, loads
    asyncio.run(go())


def test_bad_quantization_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"ModelConfig.quantization='int3'.*'int8'.*'int4'"):
        ModelConfig("m", zoo.load_causal_lm, {"path": "x"}, quantization="int3")
    with pytest.raises(ValueError, match=r"int4-gG' with G one of 32, 64, 128, 256"):
        ModelConfig("m", zoo.load_causal_lm, {"path": "x"}, quantization="int4-g48")
    with pytest.raises(ValueError, match=r"ModelConfig.quant_compute='fast'"):
        ModelConfig("m", zoo.load_causal_lm, {"path": "x"}, quant_compute="fast")
