"""Prefix caching on the paged KV pool: requests that share a long system prompt, with the cache and without.

Prints exactly one JSON line on stdout; progress goes to stderr.

One engine per setting (``EngineConfig(kv_cache='paged', prefix_cache=True|False)``) serves one causal LM of a
zoo OPT shape (random weights) and gets ``--requests`` requests one after the other, each the same
``--system`` random tokens followed by ``--tail`` of its own, asking ``--max-tokens`` new tokens. One warm-up
request with another prompt comes first (not counted).

Fields per setting: ``prefill_tokens`` (prompt tokens the steps computed, ``StepRecord.prefill_tokens``),
``ttft_mean_s`` (submit to first token), ``wall_s`` (all requests); ``prefill_ratio`` and ``ttft_ratio``:
cache / no cache.

    .venv/bin/python benchmarks/prefix_cache.py                            # opt-125m, CPU, ~1 minute
    .venv/bin/python benchmarks/prefix_cache.py --model opt-tiny --requests 4   # a smoke run
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="opt-125m", help="zoo OPT shape (random weights)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--system", type=int, default=512, help="tokens of the shared system prompt")
    p.add_argument("--tail", type=int, default=16, help="tokens of each request's own")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def prompts(args):
    rng = random.Random(args.seed)
    system = [rng.randrange(3, 500) for _ in range(args.system)]
    return [system + [rng.randrange(3, 500) for _ in range(args.tail)] for _ in range(args.requests)]


def run(args, prefix_cache: bool, reqs):
    from computron import EngineConfig, LaunchEngine, ModelConfig, zoo
    config = EngineConfig(kv_cache="paged", kv_block_size=args.block_size, prefix_cache=prefix_cache)
    engine = LaunchEngine(config, [ModelConfig("m", zoo.random_causal_lm,
                                               {"name": args.model, "seed": 0, "fast_init": True})], 1, 1)

    async def go():
        async with engine:
            await engine.submit("m", {"input_ids": [2, 5, 7], "max_tokens": 1})
            warm_up, ttfts, t0 = len(engine.metrics()), [], time.perf_counter()
            for p in reqs:
                start, first = time.perf_counter(), None
                async for _ in engine.stream("m", {"input_ids": p, "max_tokens": args.max_tokens}):
                    first = first or time.perf_counter()
                ttfts.append(first - start)
            wall = time.perf_counter() - t0
            steps = [r for r in engine.metrics()[warm_up:] if r.kind == "step"]
            return {"prefill_tokens": sum(s.prefill_tokens for s in steps),
                    "ttft_mean_s": sum(ttfts) / len(ttfts), "wall_s": wall}
    out = asyncio.run(go())
    print(f"[prefix_cache={prefix_cache}] {json.dumps(out)}", file=sys.stderr, flush=True)
    return out


def main(argv=None):
    args = parse_args(argv)
    reqs = prompts(args)
    doc = {"benchmark": "prefix_cache", "model": args.model, "requests": args.requests, "system": args.system,
           "tail": args.tail, "max_tokens": args.max_tokens, "block_size": args.block_size}
    doc["cache"], doc["no_cache"] = run(args, True, reqs), run(args, False, reqs)
    doc["prefill_ratio"] = doc["cache"]["prefill_tokens"] / doc["no_cache"]["prefill_tokens"]
    doc["ttft_ratio"] = doc["cache"]["ttft_mean_s"] / doc["no_cache"]["ttft_mean_s"]
    print(json.dumps(doc))


if __name__ == "__main__":
    main()
