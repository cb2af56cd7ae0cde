"""Tiny OPT and Llama served through the engine on this machine's device equal transformers' greedy
``generate`` on the CPU, with our swap and with paper mode, each answer given after a swap.

Prints one JSON line; exits 1 if any answer differs. Part of ``benchmarks/gpu_check.sh``; runs on a CPU too.
"""
import asyncio
import json
import tempfile


from computron import EngineConfig, LaunchEngine, ModelConfig, zoo

PROMPTS = [[2, 5, 6, 7], [2, 9], [2, 11, 12, 13, 14]]
MAX_TOKENS = 6


def reference(path):
    model = zoo.load_causal_lm(path)
    return [zoo.reference_generate(model, p, MAX_TOKENS).tolist() for p in PROMPTS]


async def serve(paths, paper):
    configs = [ModelConfig(n, zoo.load_causal_lm, {"path": p}) for n, p in paths.items()]
    engine = LaunchEngine(EngineConfig(max_loaded=1, paper_mode=paper), configs, 1, 1)
    async with engine:
        got = {}
        for _ in range(2):  # round twice: every answer comes after a swap
            for n in paths:
                got[n] = [(await engine.submit(n, {"input_ids": p, "max_tokens": MAX_TOKENS})).tolist()
                          for p in PROMPTS]
        return got, engine.workers[0].device


def main():
    d = tempfile.mkdtemp()
    paths = {n: zoo.save_random_causal_lm(f"{n}-tiny", f"{d}/{n}", seed=1) for n in ("opt", "llama")}
    refs = {n: reference(p) for n, p in paths.items()}
    res = {"check": "correctness"}
    for mode in ("ours", "paper"):
        got, res["device"] = asyncio.run(serve(paths, mode == "paper"))
        res[mode] = {n: got[n] == refs[n] for n in paths}
    print(json.dumps(res), flush=True)
    raise SystemExit(0 if all(all(res[m].values()) for m in ("ours", "paper")) else 1)


if __name__ == "__main__":
    main()
