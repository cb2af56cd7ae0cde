"""Tiny random-weight checkpoints of the decoder families the engine should shard, each with the
non-default config values that trip a sharder up (tied or untied heads, sliding windows, q/k norms,
fused projections, partial rotary, multipliers, experts).

``FAMILIES`` maps a family name to ``build(root) -> checkpoint directory`` (``root/<name>``, written
with ``save_pretrained`` as safetensors, kept if already there). Every model has 4 layers (PP=2 gives
each stage 2), head and KV-head counts even (TP=2 divides them), a hidden size of 64 or so, and
``initializer_range=0.2`` so that greedy continuations of random weights are not one token repeated;
biases and norm weights (transformers starts them at 0 and 1) get noise too, so that a bias or norm
weight applied twice, dropped or sliced wrongly changes the answers.
Token ids 0, 1, 2 are pad, BOS and EOS everywhere; prompts should use ids from 3 up.

Used by tests/engine/test_families.py; a benchmark or a GPU script can build the same checkpoints.
"""
import os

import torch

from computron.testing.zoo import write_checkpoint

SEED = 1234
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
# the shape most families share: 4 layers, 4 heads of 16 over a hidden size of 64, 2 KV heads
COMMON = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, max_position_embeddings=128, initializer_range=0.2, **IDS)


def save(root, name: str, config, seed: int = SEED) -> str:
    """Build ``config``'s causal LM with seeded random weights and save it to ``root/name``."""
    from transformers import AutoModelForCausalLM
    path = os.path.join(os.fspath(root), name)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        raise RuntimeError(f"cannot write {path}: this process is rank {dist.get_rank()} of a torch.distributed "
                           "group (an engine's master lives here?), where save_pretrained writes nothing; build "
                           "the checkpoints before launching an engine")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    with torch.no_grad():  # transformers starts biases at 0 and norms at 1: a misplaced one would not show
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p), alpha=0.2)
    return write_checkpoint(path, model.save_pretrained)


def llama(root):
    """Untied lm_head, llama3 rope scaling, biases on attention and MLP."""
    from transformers import LlamaConfig
    rope = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    return save(root, "llama", LlamaConfig(vocab_size=512, tie_word_embeddings=False, rope_parameters=rope,
                                           attention_bias=True, mlp_bias=True, **COMMON))


def mistral(root):
    """A sliding window of 4, shorter than most prompts."""
    from transformers import MistralConfig
    return save(root, "mistral", MistralConfig(vocab_size=384, sliding_window=4, head_dim=16, **COMMON))


def qwen2(root):
    """lm_head tied to the embeddings; biases on q/k/v only."""
    from transformers import Qwen2Config
    return save(root, "qwen2", Qwen2Config(vocab_size=448, tie_word_embeddings=True, **COMMON))


def qwen3(root):
    """Per-head q/k RMSNorms, untied, and head_dim * heads (128) != hidden_size (64)."""
    from transformers import Qwen3Config
    return save(root, "qwen3", Qwen3Config(vocab_size=512, tie_word_embeddings=False, head_dim=32, **COMMON))


def smollm3(root):
    """``no_rope_layers``: layers 1 and 2 use no rotary embedding (one on each PP=2 stage)."""
    from transformers import SmolLM3Config
    return save(root, "smollm3", SmolLM3Config(vocab_size=512, no_rope_layers=[1, 0, 0, 1],
                                               tie_word_embeddings=False, **COMMON))


def gemma3_text(root):
    """Sliding window 4 on layers 0 and 2, full attention on 1 and 3 (each stage mixes both), final logits
    soft-capped at 3 (about half their range: it changes the sampled distribution, not the greedy
    argmax), ``query_pre_attn_scalar`` != head_dim, embeddings scaled by sqrt(hidden). Untied: tied, the
    scaled embeddings dominate and greedy repeats one token (qwen2 and smollm3 cover tied heads)."""
    from transformers import Gemma3TextConfig
    return save(root, "gemma3_text", Gemma3TextConfig(
        vocab_size=512, head_dim=16, sliding_window=4, final_logit_softcapping=3.0, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        tie_word_embeddings=False, **COMMON))


def granite(root):
    """Embedding, residual and attention multipliers and a logits scale (logits divided by 4), none of
    them 1."""
    from transformers import GraniteConfig
    return save(root, "granite", GraniteConfig(vocab_size=512, embedding_multiplier=4.0, residual_multiplier=0.5,
                                               attention_multiplier=0.125, logits_scaling=4.0,
                                               tie_word_embeddings=False, **COMMON))


def olmo2(root):
    """q/k RMSNorms over the whole projection (all heads at once), norms after attention and MLP."""
    from transformers import Olmo2Config
    return save(root, "olmo2", Olmo2Config(vocab_size=512, tie_word_embeddings=False, **COMMON),
                seed=1)  # with SEED, one test prompt's greedy answer is one token repeated


def phi3(root):
    """Fused ``qkv_proj`` (with fewer KV heads than heads) and ``gate_up_proj``, rotary on half of each head."""
    from transformers import Phi3Config
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    return save(root, "phi3", Phi3Config(vocab_size=512, rope_parameters=rope, tie_word_embeddings=False,
                                         **COMMON))


def _gpt_neox(root, name, parallel):
    from transformers import GPTNeoXConfig
    kw = {k: v for k, v in COMMON.items() if k != "num_key_value_heads"}  # no GQA: fused per-head q/k/v
    kw["initializer_range"] = 0.3  # at 0.2 greedy alternates two tokens
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    return save(root, name, GPTNeoXConfig(vocab_size=512, rope_parameters=rope, use_parallel_residual=parallel,
                                          tie_word_embeddings=False, **kw))


def gpt_neox(root):
    """Fused ``query_key_value`` laid out per head, rotary on a quarter of each head, parallel residual."""
    return _gpt_neox(root, "gpt_neox", True)


def gpt_neox_serial(root):
    """As ``gpt_neox`` with ``use_parallel_residual=False`` (attention, then MLP on its output)."""
    return _gpt_neox(root, "gpt_neox_serial", False)


def mixtral(root):
    """4 experts, top-2 routing."""
    from transformers import MixtralConfig
    kw = dict(COMMON, intermediate_size=32)
    return save(root, "mixtral", MixtralConfig(vocab_size=512, num_local_experts=4, num_experts_per_tok=2,
                                               tie_word_embeddings=False, **kw))


def qwen3_moe(root):
    """4 experts, top-2 with renormalised weights, q/k norms; layer 0 is a dense MLP (``mlp_only_layers``)."""
    from transformers import Qwen3MoeConfig
    return save(root, "qwen3_moe", Qwen3MoeConfig(vocab_size=512, num_experts=4, num_experts_per_tok=2,
                                                  moe_intermediate_size=32, norm_topk_prob=True,
                                                  mlp_only_layers=[0], tie_word_embeddings=False, **COMMON))


def opt(root):
    """The control: served today."""
    from transformers import OPTConfig
    return save(root, "opt", OPTConfig(vocab_size=512, hidden_size=64, num_hidden_layers=4, ffn_dim=128,
                                       num_attention_heads=4, word_embed_proj_dim=64, max_position_embeddings=128,
                                       init_std=0.2, **IDS))


def wide_llama(root):
    """32 heads of 8 over a hidden size of 256 and 8 KV heads: TP=16 leaves each rank 2 heads and half a
    KV head (KV heads must be replicated, not split)."""
    from transformers import LlamaConfig
    kw = dict(COMMON, hidden_size=256, num_attention_heads=32, num_key_value_heads=8, head_dim=8,
              intermediate_size=512)
    return save(root, "wide_llama", LlamaConfig(vocab_size=512, tie_word_embeddings=False, **kw))


FAMILIES = {f.__name__: f for f in (opt, llama, mistral, qwen2, qwen3, smollm3, gemma3_text, granite, olmo2, phi3,
                                    gpt_neox, gpt_neox_serial, mixtral, qwen3_moe)}
"""family name -> ``build(root) -> checkpoint directory``."""
