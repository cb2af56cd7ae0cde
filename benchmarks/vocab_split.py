"""Vocabulary-parallel embedding and LM head: the bytes one rank's shard (what a swap moves) holds.

Prints exactly one JSON line on stdout; progress goes to stderr.

A random Llama-shaped checkpoint with a large vocabulary (``--vocab``, 50,257 by default; untied embedding
and LM head) is served at TP=1 and at ``--tp`` from its directory, and each engine reports the largest
rank's shard bytes (``snapshot().models[m].host_bytes``), the bytes a swap of the model moves on that rank.
From them:

- ``embed_bytes``: the embedding plus the LM head, whole (vocab x hidden x 2 x dtype bytes);
- ``layer_bytes``: the rest, from the TP=1 shard;
- ``tp_shard_bytes``: the measured TP shard; ``tp_replicated_bytes``: what a TP shard would be with the
  embedding and LM head whole on every rank (how they were served before: ``layer_bytes / tp + embed_bytes``);
- ``embed_share_moved``: the embedding and LM head bytes one TP rank's swap moves, as a share of them
  whole (``1 / tp`` when split by vocabulary, 1 when replicated).

    .venv/bin/python benchmarks/vocab_split.py            # hidden 256, 4 layers, TP=2 (about a minute)
    .venv/bin/python benchmarks/vocab_split.py --quick    # hidden 64, 2 layers (the tests' path)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="hidden 64, 2 layers")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.layers = 64, 2
    return args


def build(path: str, args) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(path)


def shard_bytes(path: str, tp: int) -> int:
    from computron import EngineConfig, LaunchEngine, ModelConfig, zoo
    engine = LaunchEngine(EngineConfig(), [ModelConfig("m", zoo.load_causal_lm, {"path": path}, checkpoint=path)],
                          tp_world_size=tp)
    try:
        return engine.snapshot().models["m"].host_bytes
    finally:
        engine.close()


def main(argv=None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        build(tmp, args)
        print(f"serving a {args.vocab}-token vocabulary at TP=1 and TP={args.tp}", file=sys.stderr)
        whole, split = shard_bytes(tmp, 1), shard_bytes(tmp, args.tp)
    embed = 2 * args.vocab * args.hidden * 4
    layers = whole - embed
    replicated = layers // args.tp + embed
    doc = {"benchmark": "vocab_split", "vocab": args.vocab, "hidden": args.hidden, "layers": args.layers,
           "tp": args.tp, "embed_bytes": embed, "layer_bytes": layers, "tp1_shard_bytes": whole,
           "tp_shard_bytes": split, "tp_replicated_bytes": replicated,
           "embed_share_moved": round((split - layers / args.tp) / embed, 4),
           "shard_vs_replicated": round(split / replicated, 4)}
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
