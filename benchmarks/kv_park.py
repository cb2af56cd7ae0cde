"""What a preempted model's KV park moves: the dynamic cache against the paged pool, against the model's formula.

Prints exactly one JSON line on stdout.

One unsharded causal LM (a random-weight ``computron.zoo`` shape, ``--model``) prefills ``--batch`` prompts of
mixed lengths (8 to ``--max-prompt`` tokens, seeded) and decodes ``--steps`` tokens each, the way
``CausalLMRunner.step`` drives it, in each KV layout; then the model is preempted and its running sequences'
KV parked as from a GPU (``RunningBatch.park`` reports the padded caches a GPU's park copies;
``PagedBatch.park(copy=True)`` copies the blocks in use). Fields per layout: ``moved_bytes`` (what the park copied),
``formula_bytes`` (tokens held x 2 x layers x KV heads x head dim x element size: what the sequences' keys and
values take) and ``moved_over_formula``; the dynamic cache pads every row to the longest, the pool wastes at
most a block per sequence.

    .venv/bin/python benchmarks/kv_park.py                       # llama-tiny shapes, seconds
    .venv/bin/python benchmarks/kv_park.py --model opt-125m --max-prompt 512
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_step import step_once  # noqa: E402 - a step as the runner drives it


def serve_then_park(model, kind: str, prompts, steps: int, block_size: int) -> dict:
    from computron.models.decode_compile import DecodeCompiler
    from computron.models.kv_pool import token_kv_bytes
    from computron.models.paged_running import PagedBatch
    from computron.models.running import RunningBatch
    backbone = DecodeCompiler(model.base_model, "off", torch.device("cpu"))
    rb = PagedBatch(model.config, block_size=block_size) if kind == "paged" else RunningBatch()
    specs = [SimpleNamespace(sid=i, max_tokens=steps + 1) for i in range(len(prompts))]
    with torch.inference_mode():
        for step in range(steps + 1):
            step_once(model, backbone, kind, rb, prompts if step == 0 else [], specs, torch.device("cpu"))
    tokens = sum(len(p) + steps for p in prompts)
    moved = rb.park(copy=True) if kind == "paged" else rb.park()
    want = tokens * token_kv_bytes(model.config)
    return {"moved_bytes": moved, "tokens": tokens, "formula_bytes": want, "moved_over_formula": round(moved / want, 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-tiny", help="a computron.zoo shape (random weights)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)
    from computron import zoo
    model = zoo.random_causal_lm(args.model, seed=0)
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, args.max_prompt + 1, (args.batch,), generator=gen).tolist()
    prompts = [torch.randint(3, min(1000, model.config.vocab_size), (n,), generator=gen).tolist() for n in lengths]
    out = {"bench": "kv_park", "model": args.model, "batch": args.batch, "prompt_lengths": lengths,
           "steps": args.steps, "block_size": args.block_size}
    for kind in ("dynamic", "paged"):
        out[kind] = serve_then_park(model, kind, prompts, args.steps, args.block_size)
    out["paged_over_dynamic"] = round(out["paged"]["moved_bytes"] / out["dynamic"]["moved_bytes"], 3)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
