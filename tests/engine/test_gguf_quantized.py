"""A quantized GGUF file served at its own bytes: every layout and compute mode answers as transformers does.

The file is a tiny Llama (hidden 64, 4 heads / 2 KV heads, 2 layers) whose Linears are stored as Q4_0,
Q4_1 and Q8_0 blocks (``gguf.quants.quantize``), its embedding as Q8_0 and its norms as F32. The engine
reads the Linears' blocks as they are (no float copy anywhere: the metadata directory holds no weights, the
host copy holds the blocks), splits them over TP=2 (row-parallel Linears get whole blocks) or PP=2, and
computes them expanded or packed; transformers reads the same file dequantized to float32 by the gguf
package. Greedy answers must be equal token for token.
"""
import asyncio
import os

import pytest
from helpers import greedy_reference

from computron import EngineConfig, LaunchEngine, ModelConfig, loading
from computron.storage import gguf as gguf_files

np = pytest.importorskip("numpy")
MAX_TOKENS = 10
PROMPTS = ([1, 5, 17, 33, 9], [1, 40, 7, 25, 31, 60, 3, 12])
TYPES = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_1", "ffn_gate": "Q4_0",
         "ffn_up": "Q4_1", "ffn_down": "Q4_0"}


def write_quantized_llama_gguf(path, seed: int = 3) -> str:
    import gguf
    rng = np.random.default_rng(seed)
    vocab, hidden, layers, ffn, heads, kv = 64, 64, 2, 128, 4, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-quantized-llama")
    w.add_context_length(64)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<|endoftext|>", "<s>", "</s>"] + [f"t{i}" for i in range(vocab - 3)])
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_token_scores([0.0] * vocab)
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)

    def q(name, rows, cols, qtype):
        data = (rng.standard_normal((rows, cols)) * 0.3).astype(np.float32)
        t = gguf.GGMLQuantizationType[qtype]
        w.add_tensor(name, gguf.quants.quantize(data, t), raw_dtype=t)
    q("token_embd.weight", vocab, hidden, "Q8_0")
    q("output.weight", vocab, hidden, "Q8_0")
    shapes = {"attn_q": (hidden, hidden), "attn_k": (hidden // heads * kv, hidden),
              "attn_v": (hidden // heads * kv, hidden), "attn_output": (hidden, hidden), "ffn_gate": (ffn, hidden),
              "ffn_up": (ffn, hidden), "ffn_down": (hidden, ffn)}
    for i in range(layers):
        for name, (rows, cols) in shapes.items():
            q(f"blk.{i}.{name}.weight", rows, cols, TYPES[name])
        w.add_tensor(f"blk.{i}.attn_norm.weight", (1 + 0.2 * rng.standard_normal(hidden)).astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.2 * rng.standard_normal(hidden)).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("qgguf")
    os.environ.setdefault("COMPUTRON_CACHE_DIR", str(root / "cache"))
    return write_quantized_llama_gguf(root / "tiny-q.gguf")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "pp2"])
def test_quantized_gguf_matches_transformers(quantized_gguf, tp, pp):
    reference = loading.load_causal_lm(quantized_gguf)  # transformers, dequantized by the gguf package
    refs = [greedy_reference(reference, p, MAX_TOKENS).tolist() for p in PROMPTS]
    assert len({t for r in refs for t in r}) >= 4  # not one token repeated: the comparison can fail
    configs = [ModelConfig(m, loading.load_causal_lm, {"path": quantized_gguf}, checkpoint=quantized_gguf,
                           quant_compute=m) for m in ("expand", "packed")]

    async def go():
        engine = await asyncio.to_thread(LaunchEngine, EngineConfig(max_loaded=1, max_batch_size=4), configs, tp, pp)
        async with engine:
            meta = configs[0].checkpoint
            assert meta == gguf_files.cache_dir(quantized_gguf)
            assert not [f for f in os.listdir(meta) if f.endswith(".safetensors")]
            host = sum(w.host_bytes["expand"] for w in engine.workers.values())
            assert host < os.path.getsize(quantized_gguf) * 1.6, host  # blocks as the file holds them (+ embeddings)
            for _ in range(2):
                for m in ("expand", "packed"):
                    outs = await asyncio.gather(*[engine.submit(m, {"input_ids": p, "max_tokens": MAX_TOKENS})
                                                  for p in PROMPTS])
                    assert [o.tolist() for o in outs] == refs, f"{m} at tp={tp} pp={pp}"
                    snap = engine.snapshot().models[m]
                    assert snap.weight_format in ("gguf:Q4_0", "gguf:Q4_1"), snap.weight_format
                    if m == "expand":  # the expanded float weights are on the device beside the blocks
                        assert snap.device_bytes > 2 * snap.host_bytes, (snap.device_bytes, snap.host_bytes)
    asyncio.run(go())
